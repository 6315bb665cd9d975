//! `--device`: parses the name and, for `cuda`, opens the GPU and registers
//! the CUDA backend (one line of error when there is none).

use anyhow::{anyhow, Result};
use tessera::runtime::device::Device;

/// The device named `name`, ready for use.
pub fn open(name: &str) -> Result<Device> {
    let device = Device::parse(name)?;
    if device == Device::Cuda {
        tessera_cuda::register().map_err(|e| anyhow!("--device cuda: {}", e.message))?;
        if let Ok(b) = tessera_cuda::backend() {
            eprintln!("device: {}", b.describe());
        }
    }
    Ok(device)
}
