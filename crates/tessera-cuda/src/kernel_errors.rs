//! Errors that kernels find: an index out of range in a gather or a
//! scatter, an integer division by zero, an integer raised to a negative
//! power. A kernel cannot return an error, and checking the values on
//! the host first would download them — a synchronisation in the middle of
//! every step that embeds tokens or gathers targets, which no CUDA graph
//! can record. So the kernel checks each value itself, skips the element
//! of a bad one (no access out of bounds) and writes the first bad value
//! to an error record in host memory mapped into the device; the host
//! reads the record after each synchronisation (a download, an explicit
//! `synchronize`) and returns the error then, with what it noted of the
//! launch when it queued it (the op, the dim's size, the operands' shapes
//! and dtypes, the user's line). Until then the outputs of the launch that
//! failed and of work that read them are unspecified (their elements for
//! bad indices are skipped), as with PyTorch's asynchronous CUDA errors —
//! but the device stays usable: the record is cleared when read.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::driver::{result as cu, sys};

use crate::driver_error;

/// The record's layout, shared with the kernels' `TesseraErrorRecord`
/// (codegen/index.rs): the first thread to claim `flag` writes the rest.
#[repr(C)]
struct ErrorRecord {
    flag: u32,
    site: u32,
    value: i64,
}

/// What the host noted of a checked launch: the error message before the
/// bad value is known, as a prefix and a suffix around it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Site {
    pub op: String,
    /// What the kernel checks, and so what the value it reports is.
    pub check: Check,
    /// The operands, the user's line ("indices i64 [3] into f32 [3, 4] at …").
    pub context: String,
}

/// What a checked kernel checks.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Check {
    /// An index value against a bound ("out of range for a dim of size 5");
    /// the report's value is the bad index.
    Index(String),
    /// An integer divisor against zero; the report's value is the dividend.
    DivisionByZero,
    /// An integer exponent against negative values; the report's value is
    /// the exponent.
    NegativePower,
}

impl Site {
    fn message(&self, value: i64) -> String {
        let found = match &self.check {
            Check::Index(check) => format!("index {value} is {check}"),
            Check::DivisionByZero => format!("integer division by zero ({value} / 0)"),
            Check::NegativePower => {
                format!("integers to negative integer powers are not allowed (exponent {value})")
            }
        };
        format!(
            "{found} (found by the kernel, reported at the next synchronisation; {})",
            self.context
        )
    }
}

/// Where a checked launch is being queued, for its late report: the
/// user's line of an eager op (` at file:line:col`), else ` in a compiled
/// run` (whose kernels have no single user's line).
pub fn launched_at() -> String {
    match tessera::error::dispatch_site() {
        Some(loc) => format!(" at {loc}"),
        None => " in a compiled run".to_string(),
    }
}

/// A kernel's error, as the host reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelError {
    pub op: String,
    pub message: String,
}

/// The error record and the launch sites the kernels name by number.
pub struct KernelErrors {
    host: *mut ErrorRecord,
    /// The record's address on the device.
    pub device: u64,
    sites: Mutex<Sites>,
}

#[derive(Default)]
struct Sites {
    list: Vec<Site>,
    ids: HashMap<Site, u32>,
}

// SAFETY: the record is written by kernels and read or cleared by the host
// only after a synchronisation, through volatile accesses; the sites are
// behind a mutex.
unsafe impl Send for KernelErrors {}
unsafe impl Sync for KernelErrors {}

/// Sites are deduplicated; past this many distinct ones new launches share
/// the last id, whose report then names a site less precisely.
const MAX_SITES: usize = 1 << 16;

impl KernelErrors {
    /// Allocates the record (pinned host memory mapped into the device) in
    /// the current context.
    pub fn new() -> Result<KernelErrors, String> {
        let bytes = std::mem::size_of::<ErrorRecord>();
        // SAFETY: a fresh allocation of the record's size, zeroed below
        // before any kernel can see it.
        let host = unsafe { cu::malloc_host(bytes, sys::CU_MEMHOSTALLOC_DEVICEMAP) }
            .map_err(|e| driver_error("mapped host allocation", e))?
            as *mut ErrorRecord;
        unsafe {
            std::ptr::write_volatile(
                host,
                ErrorRecord {
                    flag: 0,
                    site: 0,
                    value: 0,
                },
            );
        }
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: host came from cuMemHostAlloc with DEVICEMAP.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, host as *mut c_void, 0) }
            .result()
            .map_err(|e| driver_error("mapped host address", e))?;
        Ok(KernelErrors {
            host,
            device,
            sites: Mutex::new(Sites::default()),
        })
    }

    /// The number a launch passes its kernel for `site`.
    pub fn site(&self, site: Site) -> u32 {
        let mut sites = self.sites.lock().expect("sites poisoned");
        if let Some(&id) = sites.ids.get(&site) {
            return id;
        }
        if sites.list.len() >= MAX_SITES {
            return (sites.list.len() - 1) as u32;
        }
        let id = sites.list.len() as u32;
        sites.list.push(site.clone());
        sites.ids.insert(site, id);
        id
    }

    /// The error a kernel recorded since the last call, if any, and the
    /// record cleared. Call after a synchronisation: the kernels that
    /// could write it have finished.
    pub fn take(&self) -> Option<KernelError> {
        // SAFETY: the record lives as long as self; no kernel that could
        // write it is running (the caller synchronised).
        let record = unsafe { std::ptr::read_volatile(self.host) };
        if record.flag == 0 {
            return None;
        }
        unsafe { std::ptr::write_volatile(&mut (*self.host).flag, 0) };
        let sites = self.sites.lock().expect("sites poisoned");
        Some(match sites.list.get(record.site as usize) {
            Some(site) => KernelError {
                op: site.op.clone(),
                message: site.message(record.value),
            },
            None => KernelError {
                op: "kernel".into(),
                message: format!(
                    "a kernel's check failed on the value {} at a launch it did not note",
                    record.value
                ),
            },
        })
    }
}

impl Drop for KernelErrors {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in new.
        unsafe {
            let _ = cu::free_host(self.host as *mut c_void);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_site_message_names_the_value_the_check_and_the_operands() {
        let site = Site {
            op: "index_select".into(),
            check: Check::Index("out of range for a dim of size 5".into()),
            context: "indices i64 [1] into f32 [3, 5]".into(),
        };
        let m = site.message(7);
        assert!(
            m.starts_with("index 7 is out of range for a dim of size 5"),
            "{m}"
        );
        assert!(m.ends_with("indices i64 [1] into f32 [3, 5])"), "{m}");
    }

    #[test]
    fn arithmetic_reports_say_what_was_found_and_name_the_operands() {
        let site = |check| Site {
            op: "div".into(),
            check,
            context: "div of i32 [4] by i32 [] at model.rs:3:9".into(),
        };
        let m = site(Check::DivisionByZero).message(-7);
        assert!(
            m.starts_with("integer division by zero (-7 / 0) (found by the kernel"),
            "{m}"
        );
        assert!(
            m.ends_with("div of i32 [4] by i32 [] at model.rs:3:9)"),
            "{m}"
        );
        let m = site(Check::NegativePower).message(-2);
        assert!(
            m.starts_with("integers to negative integer powers are not allowed (exponent -2)"),
            "{m}"
        );
    }
}
