//! What a compile shows: its log lines (topics `guards`, `graph`,
//! `output_code`) and, under `TESSERA_COMPILE_DEBUG=1`, every stage's
//! artifact written to `tessera_debug/<name>_<n>/`.

use std::path::{Path, PathBuf};

use super::{Executable, InputGuard};
use crate::logging::log;
use crate::tensor::trace::Traced;

/// Where [`dump`] writes, relative to the working directory.
const DEBUG_ROOT: &str = "tessera_debug";

/// Logs what is about to be compiled: the guards and the captured graph.
pub(super) fn log_inputs(name: &str, guards: &[InputGuard], traced: &Traced) {
    log("guards", || format!("{name}: guards {guards:?}"));
    log("graph", || {
        format!("{name}: captured graph:\n{}", traced.graph)
    });
}

/// Logs what was built (topic `output_code`): its kernels and schedules.
pub(super) fn log_output(exe: &Executable) {
    log("output_code", || output_code(exe));
}

/// The kernel lists and schedules of an executable, forward then backward.
fn output_code(exe: &Executable) -> String {
    exe.artifacts()
        .iter()
        .filter(|(n, _)| n.ends_with(".kernels.txt") || n.ends_with(".schedule.txt"))
        .map(|(_, t)| t.clone())
        .collect()
}

/// Whether `TESSERA_COMPILE_DEBUG=1` asks for [`dump`].
pub(super) fn dump_requested() -> bool {
    std::env::var("TESSERA_COMPILE_DEBUG").is_ok_and(|v| v == "1")
}

/// Writes every stage's artifact into `tessera_debug/<name>_<n>/` and says
/// where once per compile. A failure to write is reported, not fatal.
pub(super) fn dump(name: &str, n: usize, traced: &Traced, guards: &[InputGuard], exe: &Executable) {
    let message = match dump_into(Path::new(DEBUG_ROOT), name, n, traced, guards, exe) {
        Ok(dir) => format!(
            "tessera: compile debug artifacts of {name} in {}",
            dir.display()
        ),
        Err((dir, e)) => format!(
            "tessera: could not write compile debug artifacts to {}: {e}",
            dir.display()
        ),
    };
    eprintln!("{message}");
}

/// [`dump`] under `root`: the directory written, or the one that could not
/// be, with the error.
fn dump_into(
    root: &Path,
    name: &str,
    n: usize,
    traced: &Traced,
    guards: &[InputGuard],
    exe: &Executable,
) -> Result<PathBuf, (PathBuf, std::io::Error)> {
    let dir = root.join(format!("{name}_{n}"));
    let mut files = vec![
        ("captured.tir".to_string(), traced.graph.to_string()),
        ("guards.txt".to_string(), format!("{guards:#?}\n")),
    ];
    files.extend(exe.artifacts());
    let written = std::fs::create_dir_all(&dir).and_then(|_| {
        files
            .iter()
            .try_for_each(|(f, text)| std::fs::write(dir.join(f), text))
    });
    match written {
        Ok(()) => Ok(dir),
        Err(e) => Err((dir, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compile::CompileOptions;
    use crate::ir::DType;
    use crate::runtime::device::Device;
    use crate::tensor::trace::trace;
    use crate::tensor::Tensor;

    fn built() -> (Traced, Vec<InputGuard>, Executable) {
        let x = Tensor::zeros(&[4, 3], DType::F32);
        let t = trace("f", &[("x".into(), x.ty())], |a| {
            Ok(vec![("out".into(), (a[0].exp() * 2.0).sum(&[1], false))])
        })
        .unwrap();
        let exe = Executable::build(
            &t,
            vec![],
            &CompileOptions::default(),
            Device::Cpu,
            &Default::default(),
        )
        .unwrap();
        (t, vec![InputGuard::of(&x)], exe)
    }

    #[test]
    fn output_code_is_the_kernels_and_schedule() {
        let (_, _, exe) = built();
        let code = output_code(&exe);
        let artifacts = exe.artifacts();
        let text = |suffix: &str| {
            artifacts
                .iter()
                .find(|(n, _)| n == suffix)
                .map(|(_, t)| t.clone())
                .unwrap_or_else(|| panic!("{suffix} in {artifacts:?}"))
        };
        let want = text("forward.kernels.txt") + &text("forward.schedule.txt");
        assert_eq!(code, want, "kernels then schedule, no graph or memory plan");
    }

    #[test]
    fn the_dump_writes_every_artifact_in_its_own_directory() {
        let (traced, guards, exe) = built();
        let root = std::env::temp_dir().join(format!("tessera-dump-{}", std::process::id()));
        let dir = dump_into(&root, "model_7", 2, &traced, &guards, &exe).unwrap();
        assert_eq!(dir, root.join("model_7_2"));
        let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap();
        assert_eq!(read("captured.tir"), traced.graph.to_string());
        assert!(
            read("guards.txt").contains("shape: ["),
            "{}",
            read("guards.txt")
        );
        for (file, text) in exe.artifacts() {
            assert_eq!(read(&file), text, "{file}");
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn a_dump_that_cannot_be_written_says_where() {
        let (traced, guards, exe) = built();
        // A file where the directory should go.
        let root = std::env::temp_dir().join(format!("tessera-dump-file-{}", std::process::id()));
        std::fs::write(&root, "not a directory").unwrap();
        let (dir, _) = dump_into(&root, "f", 1, &traced, &guards, &exe).unwrap_err();
        assert_eq!(dir, root.join("f_1"));
        std::fs::remove_file(&root).unwrap();
    }
}
