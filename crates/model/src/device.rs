//! The compute device, chosen at run time: `--device auto|cpu|cuda[:N]`.
//!
//! The CUDA backend is compiled in (feature `cuda`, on by default in the `eyrie` binary) without needing CUDA on
//! the build machine: the driver library is loaded dynamically, and only when a command asks for it. `auto` picks
//! CUDA device 0 when a driver and a device are present, the CPU otherwise.

use std::fmt;
use std::str::FromStr;

/// What the user asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// CUDA device 0 if usable, else the CPU.
    #[default]
    Auto,
    /// The CPU backend.
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

/// The device a command will actually run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ResolvedDevice {
    /// The CPU backend.
    Cpu,
    /// A CUDA device by ordinal.
    Cuda(usize),
}

impl fmt::Display for ResolvedDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ResolvedDevice::Cpu => f.write_str("cpu"),
            ResolvedDevice::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// A `--device` value that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The string is not `auto`, `cpu`, `cuda` or `cuda:N`.
    #[error("--device: {0:?} is not one of auto, cpu, cuda, cuda:N")]
    Parse(String),
    /// CUDA was asked for but this binary was built without the `cuda` feature.
    #[error("--device cuda: this binary was built without CUDA support (feature `cuda`)")]
    NotBuilt,
    /// CUDA was asked for but no driver or no such device is present.
    #[error("--device {asked}: {reason}")]
    Unavailable {
        /// What was asked (`cuda:1`).
        asked: String,
        /// Why it cannot be used.
        reason: String,
    },
}

impl FromStr for DeviceChoice {
    type Err = DeviceError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" | "gpu" => Ok(DeviceChoice::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceChoice::Cuda)
                .ok_or_else(|| DeviceError::Parse(s.to_string())),
        }
    }
}

impl DeviceChoice {
    /// Resolves the choice against what this machine has.
    pub fn resolve(self) -> Result<ResolvedDevice, DeviceError> {
        match self {
            DeviceChoice::Cpu => Ok(ResolvedDevice::Cpu),
            DeviceChoice::Auto => Ok(match cuda_device_count() {
                Ok(n) if n > 0 => ResolvedDevice::Cuda(0),
                _ => ResolvedDevice::Cpu,
            }),
            DeviceChoice::Cuda(i) => {
                let n = cuda_device_count()?;
                if i < n {
                    Ok(ResolvedDevice::Cuda(i))
                } else {
                    Err(DeviceError::Unavailable {
                        asked: format!("cuda:{i}"),
                        reason: format!("only {n} CUDA device(s) present"),
                    })
                }
            }
        }
    }
}

/// Number of CUDA devices the driver reports; an error when the driver cannot be loaded or initialised.
#[cfg(feature = "cuda")]
pub fn cuda_device_count() -> Result<usize, DeviceError> {
    let unavailable = |reason: String| DeviceError::Unavailable { asked: "cuda".into(), reason };
    // SAFETY: only probes whether the driver library can be opened (dlopen), calling nothing in it.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(unavailable("no CUDA driver library (libcuda.so) found".into()));
    }
    cudarc::driver::result::init().map_err(|e| unavailable(format!("CUDA driver init failed: {e}")))?;
    let n = cudarc::driver::result::device::get_count()
        .map_err(|e| unavailable(format!("cannot count CUDA devices: {e}")))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// Number of CUDA devices: always an error in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub fn cuda_device_count() -> Result<usize, DeviceError> {
    Err(DeviceError::NotBuilt)
}

/// Runs `f` (on this thread, once) with `device`'s allocations in the backend's persistent mode: on CUDA every
/// buffer made meanwhile gets exact-size memory of its own instead of a slice of a pooled page, for buffers that
/// live as long as the model (its weights); elsewhere a plain call.
pub(crate) fn persistent_allocations<B: burn::tensor::backend::Backend, R>(
    device: &B::Device,
    f: impl FnOnce() -> R,
) -> R {
    /// burn's hook asks for `Send` input and output and an `Fn`; it calls the closure once, on the calling thread,
    /// before it returns (burn-cubecl: CubeCL's `memory_persistent_allocation`; the other backends: a plain call),
    /// so nothing here crosses a thread.
    struct Here<T>(T);
    // SAFETY: see above: the value never leaves the calling thread.
    unsafe impl<T> Send for Here<T> {}
    let Here(out) = B::memory_persistent_allocations(device, Here(f), |Here(f)| Here(f()));
    out
}

/// Whether `B` is burn's CUDA backend (kernels compile at their first launch there: servers warm up more).
pub fn is_cuda_backend<B: burn::tensor::backend::Backend>() -> bool {
    #[cfg(feature = "cuda")]
    return crate::cuda_ops::is_cuda::<B>();
    #[cfg(not(feature = "cuda"))]
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_strings() {
        assert_eq!("auto".parse(), Ok(DeviceChoice::Auto));
        assert_eq!("cpu".parse(), Ok(DeviceChoice::Cpu));
        assert_eq!("cuda".parse(), Ok(DeviceChoice::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(DeviceChoice::Cuda(3)));
        assert!(matches!("tpu".parse::<DeviceChoice>(), Err(DeviceError::Parse(_))));
        assert!(matches!("cuda:x".parse::<DeviceChoice>(), Err(DeviceError::Parse(_))));
    }

    #[test]
    fn cpu_always_resolves_and_auto_never_fails() {
        assert_eq!(DeviceChoice::Cpu.resolve(), Ok(ResolvedDevice::Cpu));
        // On a machine without a GPU auto falls back to the CPU; with one it picks cuda:0.
        assert!(DeviceChoice::Auto.resolve().is_ok());
    }

    #[test]
    fn cuda_without_a_driver_is_a_clear_error() {
        if cuda_device_count().is_err() {
            let err = DeviceChoice::Cuda(0).resolve().unwrap_err();
            assert!(err.to_string().starts_with("--device"), "{err}");
        }
    }
}
