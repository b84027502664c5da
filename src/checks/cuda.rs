//! cuda.driver-api and cuda.init: what a CUDA application meets when it starts.

use super::Finding;
use crate::collect::cuda::{version_string, MIN_DRIVER_API};
use crate::snapshot::{CudaStage, CudaStatus, Snapshot};

/// CUresult codes with their own advice.
const CUDA_ERROR_NO_DEVICE: i32 = 100;
const CUDA_ERROR_SYSTEM_NOT_READY: i32 = 802;
const CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: i32 = 804;
const CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: i32 = 803;

pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    let no_gpu = s.gpus().is_empty();
    match &s.cuda {
        CudaStatus::NotRead(why) => {
            for id in ["cuda.driver-api", "cuda.init"] {
                out.push(if no_gpu {
                    Finding::pass(id, "no NVIDIA GPU: nothing to check")
                } else {
                    Finding::unknown(id, why.clone())
                });
            }
        }
        CudaStatus::Failed { stage: CudaStage::Library, message, .. } => {
            out.push(if no_gpu {
                Finding::pass("cuda.driver-api", "no libcuda and no NVIDIA GPU: nothing to check")
            } else {
                Finding::fail("cuda.driver-api", "libcuda is not installed: no CUDA program can start")
                    .detail(message.clone())
                    .remedy("Install the driver's compute libraries (`libnvidia-compute-<branch>` / `nvidia-driver-cuda`); `phq-agent install` does it.")
            });
            out.push(if no_gpu {
                Finding::pass("cuda.init", "no NVIDIA GPU: nothing to initialise")
            } else {
                Finding::unknown("cuda.init", "cuInit not tried: libcuda is not installed")
            });
        }
        CudaStatus::Failed { stage: CudaStage::DriverVersion, message, .. } => {
            out.push(
                Finding::fail("cuda.driver-api", format!("cuDriverGetVersion failed: {message}"))
                    .remedy("Reinstall the driver (`phq-agent install`); the CUDA library is unusable."),
            );
            out.push(Finding::unknown("cuda.init", "cuInit not tried: the CUDA library is unusable"));
        }
        CudaStatus::Failed { stage: CudaStage::Init, code, message } => {
            out.push(Finding::pass("cuda.driver-api", "libcuda is installed"));
            out.push(init_failure(*code, message).evidence("code", code));
        }
        CudaStatus::Ok { driver_api_version, devices } => {
            let v = version_string(*driver_api_version);
            out.push(
                if *driver_api_version >= MIN_DRIVER_API {
                    Finding::pass("cuda.driver-api", format!("libcuda offers CUDA {v}"))
                } else {
                    Finding::fail(
                        "cuda.driver-api",
                        format!("libcuda offers only CUDA {v}: CUDA 12 programs will not run"),
                    )
                    .remedy("Upgrade the driver to a CUDA 12 branch (≥ 525; `phq-agent install`).")
                }
                .evidence("driver_api_version", driver_api_version),
            );
            let bound = s.gpus().iter().filter(|g| g.driver.as_deref() == Some("nvidia")).count() as u32;
            out.push(
                if *devices < bound {
                    Finding::fail("cuda.init", format!("CUDA sees {devices} of the {bound} GPUs bound to nvidia"))
                        .remedy(
                        "A GPU failed to initialise for CUDA: look at gpu.xid and `dmesg | grep NVRM`; restart the VM.",
                    )
                } else {
                    Finding::pass("cuda.init", format!("cuInit succeeded; {devices} CUDA device(s)"))
                }
                .evidence("devices", devices),
            );
        }
    }
}

fn init_failure(code: Option<i32>, message: &str) -> Finding {
    const ID: &str = "cuda.init";
    match code {
        Some(CUDA_ERROR_SYSTEM_NOT_READY) => Finding::fail(ID, "cuInit fails with error 802: the NVSwitch fabric is not set up")
            .detail(format!("{message}. On a VM with NVSwitches the fabric manager must train NVLink before CUDA can start; see fabric.manager-running."))
            .remedy("`systemctl enable --now nvidia-fabricmanager` (installed at exactly the driver's version), then run doctor again."),
        Some(CUDA_ERROR_NO_DEVICE) => Finding::fail(ID, "cuInit: no CUDA-capable device is visible")
            .detail(format!("{message}. The driver holds no usable GPU (see pci.gpu-driver-bound, nvml.init), or CUDA_VISIBLE_DEVICES hides them."))
            .remedy("Fix the driver binding first (pci.gpu-driver-bound), and check `CUDA_VISIBLE_DEVICES` in the environment."),
        Some(CUDA_ERROR_SYSTEM_DRIVER_MISMATCH) | Some(CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE) => Finding::fail(ID, "cuInit: the CUDA library does not match the kernel driver")
            .detail(message.to_string())
            .remedy("Reboot after a driver upgrade, or remove a stray cuda-compat package that does not match this driver."),
        _ => Finding::fail(ID, format!("cuInit failed: {message}")).remedy("Read `dmesg | grep NVRM` for the driver's reason; restart the VM if a GPU was lost."),
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::checks::Severity;

    fn findings(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &mut out);
        out
    }

    #[test]
    fn healthy_passes() {
        assert!(findings(&healthy()).iter().all(|f| f.severity == Severity::Pass));
    }

    #[test]
    fn error_802_points_at_the_fabric_manager() {
        let mut s = healthy();
        s.cuda = CudaStatus::Failed {
            stage: CudaStage::Init,
            code: Some(802),
            message: "CUDA_ERROR_SYSTEM_NOT_READY (802): system not yet initialized".into(),
        };
        let f = findings(&s);
        let i = find(&f, "cuda.init")[0];
        assert_eq!(i.severity, Severity::Fail);
        assert!(i.summary.contains("802"));
        assert!(i.remedy.as_ref().unwrap().contains("nvidia-fabricmanager"));
    }

    #[test]
    fn missing_libcuda_fails_only_with_gpus() {
        let mut s = healthy();
        s.cuda = CudaStatus::Failed { stage: CudaStage::Library, code: None, message: "not found".into() };
        assert_eq!(find(&findings(&s), "cuda.driver-api")[0].severity, Severity::Fail);
        s.pci = crate::snapshot::Fact::Value(vec![]);
        assert_eq!(find(&findings(&s), "cuda.driver-api")[0].severity, Severity::Pass);
    }

    #[test]
    fn no_device_and_old_api() {
        let mut s = healthy();
        s.cuda = CudaStatus::Failed {
            stage: CudaStage::Init,
            code: Some(100),
            message: "CUDA_ERROR_NO_DEVICE (100)".into(),
        };
        assert!(find(&findings(&s), "cuda.init")[0].summary.contains("no CUDA-capable device"));
        s.cuda = CudaStatus::Ok { driver_api_version: 11080, devices: 8 };
        assert_eq!(find(&findings(&s), "cuda.driver-api")[0].severity, Severity::Fail);
        s.cuda = CudaStatus::Ok { driver_api_version: 12040, devices: 7 };
        assert_eq!(find(&findings(&s), "cuda.init")[0].severity, Severity::Fail);
    }
}
