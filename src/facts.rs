//! The numbers and names the checks judge by, in one place, each with its source.
//!
//! docs/reference.md lists every table and number here with its public source (NVIDIA's open
//! GPU kernel modules README, DCGM `diag-skus.yaml.in`, the CUDA
//! toolkit release notes, azurehpc-health-checks); change both together.

/// A GPU model the agent knows by PCI device id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sku {
    pub device_id: u16,
    pub name: &'static str,
    /// Form factor decides whether NVSwitches/NVLink are expected.
    pub sxm: bool,
}

/// Hopper SKUs by PCI device id (vendor 0x10de).
/// Source: NVIDIA/open-gpu-kernel-modules README supported-GPU list; DCGM diag-skus.yaml.in.
pub const SKUS: &[Sku] = &[
    Sku { device_id: 0x2330, name: "H100 SXM5 80GB", sxm: true },
    Sku { device_id: 0x2331, name: "H100 PCIe", sxm: false },
    Sku { device_id: 0x2321, name: "H100 NVL", sxm: false },
    Sku { device_id: 0x2339, name: "H100 SXM5 94GB", sxm: true },
    Sku { device_id: 0x2337, name: "H100 SXM5 64GB", sxm: true },
    Sku { device_id: 0x2338, name: "H100 SXM5 96GB", sxm: true },
    Sku { device_id: 0x2324, name: "H800 SXM", sxm: true },
    Sku { device_id: 0x2322, name: "H800 PCIe", sxm: false },
    Sku { device_id: 0x2335, name: "H200 SXM", sxm: true },
    Sku { device_id: 0x233b, name: "H200 NVL", sxm: false },
];

pub fn sku(device_id: u16) -> Option<&'static Sku> {
    SKUS.iter().find(|s| s.device_id == device_id)
}

/// NVSwitch device ids. 0x22a3 is the third-generation NVSwitch of the HGX H100 baseboard
/// (PCI class 0x0680, Gen4 x2 link). Source: leptonai/gpud lspci-vvv capture of an HGX H100.
pub const NVSWITCH_DEVICE_IDS: &[u16] = &[0x22a3];

/// An HGX H100/H200 baseboard carries four NVSwitches for its eight GPUs.
/// Source: NVIDIA HGX H100 platform; the lspci capture shows 83:00.0–86:00.0.
pub const NVSWITCHES_PER_HGX_BOARD: usize = 4;

/// The lowest driver branch that supports Hopper and CUDA 12 at all (CUDA 12.0 GA needs
/// 525.60.13). Source: CUDA toolkit release notes, driver table.
pub const MIN_DRIVER_BRANCH: u32 = 525;

/// What NVIDIA supports a data-center driver branch as, and until when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BranchLife {
    pub branch: u32,
    /// "long-term support branch" or "production branch".
    pub kind: &'static str,
    /// The month its support ends, `YYYY-MM`.
    pub end_of_life: &'static str,
}

/// NVIDIA's support matrix for data-center drivers ("Supported Drivers and CUDA Toolkit
/// Versions", docs.nvidia.com/datacenter/tesla/drivers, the R620 edition; the R580-era edition
/// adds R535 and R570). Every branch it does not list — R550 among them — is end of life. R580's
/// end of life is June 2028 in the R620 edition and August 2028 in an earlier one; the earlier
/// date is kept so a warning is never late.
pub const DRIVER_BRANCHES: &[BranchLife] = &[
    BranchLife { branch: 535, kind: "long-term support branch", end_of_life: "2026-06" },
    BranchLife { branch: 570, kind: "production branch", end_of_life: "2026-02" },
    BranchLife { branch: 580, kind: "long-term support branch", end_of_life: "2028-06" },
    BranchLife { branch: 595, kind: "production branch", end_of_life: "2027-03" },
    BranchLife { branch: 620, kind: "long-term support branch", end_of_life: "2029-09" },
];

/// The branch `install` picks by default: the long-term support branch with the most support
/// left that every CUDA 12 toolkit runs on (R580; see DRIVER_BRANCHES).
pub const DEFAULT_DRIVER_BRANCH: u32 = 580;
/// The toolkit `install` picks by default: the newest CUDA 12 (12.9; CUDA_MIN_DRIVER).
pub const DEFAULT_CUDA: &str = "12.9";

/// The support-matrix entry of `branch`, if NVIDIA lists it.
pub fn branch_life(branch: u32) -> Option<&'static BranchLife> {
    DRIVER_BRANCHES.iter().find(|b| b.branch == branch)
}

/// Minimum Linux driver for each CUDA 12 toolkit at GA. Source: CUDA toolkit release notes.
pub const CUDA_MIN_DRIVER: &[(&str, &str)] = &[
    ("12.0", "525.60.13"),
    ("12.1", "530.30.02"),
    ("12.2", "535.54.03"),
    ("12.3", "545.23.06"),
    ("12.4", "550.54.14"),
    ("12.5", "555.42.02"),
    ("12.6", "560.28.03"),
    ("12.8", "570.26"),
    ("12.9", "575.51.03"),
    ("13.0", "580.65.06"),
];

/// The first CUDA 12 toolkit with packages for Ubuntu 24.04: NVIDIA's `ubuntu2404` repository
/// starts at CUDA 12.5, the release that added Ubuntu 24.04 to the supported distributions
/// (CUDA 12.5 release notes); 12.4 has none there (a public CI action's report: "cuda 12.4.1 gives
/// 404 error on ubuntu 24.04", Jimver/cuda-toolkit#365).
pub const UBUNTU2404_FIRST_CUDA: &str = "12.5";

/// The minimum driver for a toolkit `major.minor`, if the table knows it.
pub fn cuda_min_driver(cuda: &str) -> Option<&'static str> {
    let key = major_minor(cuda)?;
    CUDA_MIN_DRIVER.iter().find(|(c, _)| *c == key).map(|(_, d)| *d)
}

/// `12.4.131` → `12.4`.
pub fn major_minor(v: &str) -> Option<String> {
    let mut it = v.trim().split('.');
    let major: u32 = it.next()?.parse().ok()?;
    let minor: u32 = it.next().unwrap_or("0").parse().ok()?;
    Some(format!("{major}.{minor}"))
}

/// Compares dotted numeric versions (`550.54.14` vs `550.90.07`); non-numeric parts compare as 0.
pub fn version_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    let parse = |s: &str| -> Vec<u64> { s.split('.').map(|p| p.trim().parse().unwrap_or(0)).collect() };
    let (a, b) = (parse(a), parse(b));
    for i in 0..a.len().max(b.len()) {
        let (x, y) = (a.get(i).copied().unwrap_or(0), b.get(i).copied().unwrap_or(0));
        match x.cmp(&y) {
            std::cmp::Ordering::Equal => continue,
            o => return o,
        }
    }
    std::cmp::Ordering::Equal
}

/// The branch (major number) of a driver version: `550.90.07` → 550.
pub fn driver_branch(version: &str) -> Option<u32> {
    version.split('.').next()?.trim().parse().ok()
}

/// Guests `phq-agent install` supports: those NVIDIA publishes a CUDA repository for
/// (CUDA installation guide for Linux). `id` and `VERSION_ID` major from os-release.
pub const SUPPORTED_OS: &[(&str, &str, &str)] = &[
    ("ubuntu", "22.04", "Ubuntu 22.04"),
    ("ubuntu", "24.04", "Ubuntu 24.04"),
    ("debian", "12", "Debian 12"),
    ("rhel", "9", "RHEL 9"),
    ("rocky", "9", "Rocky Linux 9"),
    ("almalinux", "9", "AlmaLinux 9"),
];

/// PCIe replays tolerated per minute on a Gen5 x16 link before the link is suspect.
/// Source: DCGM `DcgmHealthWatch.cpp` (PCIe replay health watch budget).
pub const PCIE_REPLAYS_PER_MINUTE: f64 = 31.0;

/// More uncorrectable remapped rows than this fails a GPU. Source: azurehpc-health-checks
/// (H100 configuration).
pub const MAX_UNCORRECTABLE_REMAPPED_ROWS: u32 = 512;

/// Corrected (single-bit) volatile ECC errors above this warn. Source: azurehpc-health-checks
/// (SRAM correctable limit 10,000 on H100).
pub const MAX_CORRECTED_ECC: u64 = 10_000;

/// The reasons whose held-back time is a fault rather than the GPU doing its job, and the share
/// of the time since boot above which `gpu.throttle-time` warns. Power capping, sync boost and
/// low utilisation hold clocks back in normal work (DCGM's diagnostic reports thermal violations
/// during a test as an error, DCGM_FR_THERMAL_VIOLATIONS, and only records the power violation
/// among its standard information fields: DCGM's nvvs/src/DcgmRecorder.cpp); thermal,
/// board-limit and reliability slowdowns come from the host's cooling or the board. 1 % is our margin: about 15 minutes a day.
pub const FAULT_VIOLATIONS: &[&str] = &["thermal", "board_limit", "reliability"];
pub const MAX_VIOLATION_SHARE: f64 = 0.01;

/// On-die SRAM, counted apart from the HBM (`nvmlDeviceGetMemoryErrorCounter` by location):
/// any uncorrectable SRAM error, or more corrected ones than this (since the last reset or over
/// the GPU's life), fails the GPU. Source: azurehpc-health-checks `customTests/azure_gpu_ecc.nhc`
/// (`check_ecc`, fault NHC2019), called as `check_gpu_ecc 20000000 10000` by its ND H100 v5 and
/// ND H200 v5 configurations (`conf/nd96isr_h100_v5.conf`, `conf/nd96isr_h200_v5.conf`).
pub const MAX_SRAM_CORRECTED_ECC: u64 = 10_000;

/// HBM (DRAM) corrected or uncorrected errors above this, since the last reset or over the
/// GPU's life, fail the GPU. Same source: the first argument of `check_gpu_ecc`.
pub const MAX_DRAM_ECC: u64 = 20_000_000;

/// A GPU this close to its NVML slowdown threshold warns (°C). Our margin, not NVIDIA's: the
/// thresholds themselves come from NVML per GPU.
pub const TEMPERATURE_MARGIN_C: u32 = 5;

/// NVLinks per H100/H200 SXM GPU (NVLink 4). Source: `nvidia-smi nvlink -s` on HGX H100.
pub const NVLINKS_PER_SXM_GPU: usize = 18;

/// How a SKU's GPUs use NVLink, and so how many links NVML should show active on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NvlinkUse {
    /// SXM on an HGX board: every link NVML lists runs to the NVSwitches.
    Switched,
    /// PCIe cards joined in pairs by NVLink bridges, which wire `links` of the links NVML lists.
    /// `bridge_required`: the product is the bridged pair (H100 NVL), so a peer of the same SKU in
    /// the VM without links is a fault; otherwise the bridge is an option (H100 PCIe), and a card
    /// without active links simply has none fitted.
    Bridged { links: usize, bridge_required: bool },
}

/// NVLinks an NVLink bridge set wires on an H100 PCIe or H100 NVL pair: 12 of the 18 NVML lists.
/// Sources: NVIDIA's H100 PCIe product brief (PB-11133-001) and H100 NVL product page give the
/// bridged pair 600 GB/s bidirectional, which is 12 NVLink 4 links at 50 GB/s each (NVLink 4's
/// 900 GB/s over 18 links on SXM); Azure's NC H100 v5 VMs show exactly 12 active and links
/// 4, 5, 10, 11, 16, … inactive "by design" (azurehpc-health-checks#162).
pub const NVLINKS_PER_BRIDGED_H100: usize = 12;

/// The NVLink use of a SKU, or `None` where no public source says how many links it wires (H800
/// and H200 NVL, unknown ids): those GPUs are judged by every link NVML lists.
pub fn nvlink_use(device_id: u16) -> Option<NvlinkUse> {
    match device_id {
        // H100 SXM5 80 GB and its 94/64/96 GB variants; H200 SXM (NVLINKS_PER_SXM_GPU).
        0x2330 | 0x2339 | 0x2337 | 0x2338 | 0x2335 => Some(NvlinkUse::Switched),
        // H100 NVL: sold as a bridged pair (NVIDIA's H100 NVL: two cards, NVLink bridge).
        0x2321 => Some(NvlinkUse::Bridged { links: NVLINKS_PER_BRIDGED_H100, bridge_required: true }),
        // H100 PCIe: bridges optional (H100 PCIe product brief: "NVLink bridge" as an option).
        0x2331 => Some(NvlinkUse::Bridged { links: NVLINKS_PER_BRIDGED_H100, bridge_required: false }),
        _ => None,
    }
}

/// Clock-event reasons and how bad each is while it is active. Source: NVML
/// `nvmlClocksEventReason*` documentation; DCGM treats HW slowdown and power brake as
/// failures of the node's cooling or power, SW thermal as a warning.
pub const THROTTLE_SEVERITY: &[(&str, ThrottleClass)] = &[
    ("gpu_idle", ThrottleClass::Normal),
    ("applications_clocks_setting", ThrottleClass::Normal),
    ("sw_power_cap", ThrottleClass::Normal),
    ("sync_boost", ThrottleClass::Normal),
    ("display_clock_setting", ThrottleClass::Normal),
    ("sw_thermal_slowdown", ThrottleClass::Warn),
    ("hw_slowdown", ThrottleClass::Fail),
    ("hw_thermal_slowdown", ThrottleClass::Fail),
    ("hw_power_brake_slowdown", ThrottleClass::Fail),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ThrottleClass {
    Normal,
    Warn,
    Fail,
}

/// What a probe must reach on a GPU of a SKU. `None`: no sourced floor, the figure is reported
/// without judgement.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeFloors {
    pub h2d_gbps: Option<f64>,
    pub d2h_gbps: Option<f64>,
    /// Device-local copy, counting bytes read plus bytes written (the basis of DCGM's figures).
    pub d2d_gbps: Option<f64>,
    /// One GPU↔GPU peer copy over NVLink: through NVSwitches on SXM, over the bridges of a
    /// bridged PCIe pair.
    pub p2p_gbps: Option<f64>,
    /// FP32 GEMM, TFLOP/s.
    pub gemm_tflops: Option<f64>,
}

/// Host↔device pinned copies on a PCIe Gen5 x16 H100 VM: floor 48 GB/s (azurehpc-health-checks
/// `nd96isr_h100_v5.conf`; ~52–57 typical per NVIDIA/nvbandwidth#6).
const PCIE_GEN5_FLOOR_GBPS: f64 = 48.0;

/// GPU↔GPU over NVSwitch on HGX H100: floor 335 GB/s (azurehpc-health-checks). H200 has the same
/// NVLink 4 fabric (18 links), so the same floor. H800 has 8 NVLinks and reaches ~160 GB/s
/// (deepseek-ai/DeepEP#16): no public floor, so its pairs are measured, not judged.
const NVSWITCH_P2P_FLOOR_GBPS: f64 = 335.0;

/// GPU↔GPU over the NVLink bridges of an H100 NVL or H100 PCIe pair: the NVSwitch floor scaled to
/// the bridge's 12 of 18 links, 335 × 12 / 18 ≈ 223 GB/s. Healthy bridged pairs measure about
/// 257 GB/s (azurehpc-health-checks#162, NC H100 v5, where Azure's SXM floor of 335 fails every
/// healthy pair): a margin of 15 %, a little wider than the SXM floor's 12 % under the ~376 GB/s
/// healthy SXM pairs reach (NVIDIA/nccl#1264).
const BRIDGED_P2P_FLOOR_GBPS: f64 =
    NVSWITCH_P2P_FLOOR_GBPS * NVLINKS_PER_BRIDGED_H100 as f64 / NVLINKS_PER_SXM_GPU as f64;

/// Per SKU: DCGM's diagnostic floors (`diag-skus.yaml.in`): the memory-bandwidth test's floor
/// (read + write, TB/s → GB/s) and the targeted-stress FP32 GEMM target (TFLOP/s). The variants
/// of a SKU (H100 SXM5 94/64/96 GB, H800) take their family's figures; DCGM lists no others.
pub fn probe_floors(device_id: u16) -> ProbeFloors {
    let pcie = Some(PCIE_GEN5_FLOOR_GBPS);
    let sku = |hbm_gbps: f64, tflops: f64, p2p: Option<f64>| ProbeFloors {
        h2d_gbps: pcie,
        d2h_gbps: pcie,
        d2d_gbps: Some(hbm_gbps),
        p2p_gbps: p2p,
        gemm_tflops: Some(tflops),
    };
    match device_id {
        // H100 SXM5 80 GB, and its 94/64/96 GB variants.
        0x2330 | 0x2339 | 0x2337 | 0x2338 => sku(1905.0, 29.3, Some(NVSWITCH_P2P_FLOOR_GBPS)),
        // H800 SXM: H100 SXM silicon with 8 NVLinks.
        0x2324 => sku(1905.0, 29.3, None),
        // H100 PCIe: its bridged pairs' floor (a pair without a bridge has no NVLink pair to judge).
        0x2331 => sku(1230.0, 15.4, Some(BRIDGED_P2P_FLOOR_GBPS)),
        // H800 PCIe.
        0x2322 => sku(1230.0, 15.4, None),
        // H100 NVL. A second id for it could not be confirmed from a public source (NVIDIA's
        // gpu-admin-tools lists 0x233D only as "H100"), so 0x233D gets no floors.
        0x2321 => sku(2043.0, 25.6, Some(BRIDGED_P2P_FLOOR_GBPS)),
        // H200 SXM: 0.75 × 3.11 TB/s measured.
        0x2335 => sku(2333.0, 37.5, Some(NVSWITCH_P2P_FLOOR_GBPS)),
        // H200 NVL.
        0x233b => sku(2212.0, 32.2, None),
        _ => ProbeFloors { h2d_gbps: None, d2h_gbps: None, d2d_gbps: None, p2p_gbps: None, gemm_tflops: None },
    }
}

/// The share of its SKU's power target a board must reach under the power test: DCGM's
/// targeted-power test fails a GPU whose highest board-power reading stays below
/// `target_power_min_ratio` × `target_power`, 0.75 by default (DCGM diag documentation,
/// "Targeted Power"; `nvvs/plugin_src/targetedpower/TargetedPower_wrapper.cpp`,
/// `CheckGpuPowerUsage`); where the enforced power limit sits at or below that floor it does not
/// fail the GPU but says so.
pub const POWER_MIN_RATIO: f64 = 0.75;

/// DCGM's per-SKU board-power target for the targeted-power test, W (`nvvs/diag-skus.yaml.in`,
/// `targeted_power.target_power`, by PCI device id). DCGM loads Hopper boards with SGEMM there
/// (`use_dgemm: false`); the agent's load is FP64 (cuBLAS's DGEMM runs on the FP64 tensor
/// cores), its own choice, judged against the same target. `None`: DCGM gives no target.
pub fn power_target_w(device_id: u16) -> Option<f64> {
    Some(match device_id {
        // H100 80GB HBM3 (SXM5) and its 94/64/96 GB variants, H800 SXM: 700 W.
        0x2330 | 0x2339 | 0x2337 | 0x2338 | 0x2324 => 700.0,
        // H100 PCIe ("Nvidia P1010", id 2331): 350 W.
        0x2331 => 350.0,
        // H100 NVL: 399 W.
        0x2321 => 399.0,
        // H800 PCIe: 310 W.
        0x2322 => 310.0,
        // H200 SXM: 700 W; H200 NVL: 600 W.
        0x2335 => 700.0,
        0x233b => 600.0,
        _ => return None,
    })
}

/// The message Azure's all-reduce floors are measured with: 16 GiB (nccl-tests `-b 16G -e 16G`).
pub const ALLREDUCE_FLOOR_BYTES: u64 = 16 << 30;

/// NCCL all-reduce bus bandwidth floors for a whole HGX board (8 GPUs behind NVSwitches), GB/s,
/// from Azure's NCCL health check with 16 GiB messages (azurehpc-health-checks,
/// `conf/nd96isr_h100_v5.conf`: `check_nccl_allreduce 460.0 1 16G`; `conf/nd96isr_h200_v5.conf`:
/// `check_nccl_allreduce 431.0 1 16G`; its `conf/nd96is_h200_v5.conf` says 432.0 for the same
/// board, and the lower is taken). Azure publishes no figure for fewer GPUs, other SKUs or
/// smaller messages (which do not reach the plateau a 16 GiB one does): those all-reduces are
/// measured and left to the GPUs' baseline.
pub fn allreduce_floor(device_id: u16, gpus: usize, message_bytes: u64) -> Option<f64> {
    if gpus != 8 || message_bytes < ALLREDUCE_FLOOR_BYTES {
        return None;
    }
    match device_id {
        // H100 SXM5 80 GB (Azure's ND H100 v5) and its variants, as the other floors take them.
        0x2330 | 0x2339 | 0x2337 | 0x2338 => Some(460.0),
        // H200 SXM (ND H200 v5).
        0x2335 => Some(431.0),
        _ => None,
    }
}

/// NVIDIA's Debian/Ubuntu repository signing key (3bf863cc), the key inside `cuda-keyring`
/// (`usr/share/keyrings/cuda-archive-keyring.gpg`). Source: NVIDIA's CUDA repository key
/// rotation notice (April 2022) and the keyring package itself; docs/reference.md lists it.
pub const NVIDIA_REPO_KEY_FINGERPRINT: &str = "EB693B3035CD5710E231E123A4B469963BF863CC";

/// NVIDIA's RHEL 9 repository key (the file `D42D0685.pub` in `…/repos/rhel9/x86_64/`), pinned
/// by its whole fingerprint. Source: the key file itself (`gpg --show-keys D42D0685.pub`), as
/// NVIDIA's repository serves it; the same 40 digits are pinned by public EL9 installers that
/// verify it before `rpm --import`. docs/reference.md lists it.
pub const NVIDIA_RHEL_REPO_KEY_FINGERPRINT: &str = "610C7B14E068A878070DA4E99CD0A493D42D0685";

/// EPEL 9's signing key, "Fedora (epel9) <epel@fedoraproject.org>", pinned by its whole
/// fingerprint before `epel-release` is installed from a URL on RHEL (where no repository vouches
/// for it). Source: Fedora's published keys (getfedora.org's security page serves it as
/// `keys/FF8AD1344597106ECE813B918A3872BF3228467C.txt`); the official MariaDB container images
/// verify `RPM-GPG-KEY-EPEL-9` against the same 40 digits before `rpm -K` of the release package.
pub const EPEL9_KEY_FINGERPRINT: &str = "FF8AD1344597106ECE813B918A3872BF3228467C";

#[cfg(test)]
mod tests {
    use super::*;
    use std::cmp::Ordering;

    #[test]
    fn versions_compare_numerically() {
        assert_eq!(version_cmp("550.90.07", "550.54.14"), Ordering::Greater);
        assert_eq!(version_cmp("570.26", "570.26.0"), Ordering::Equal);
        assert_eq!(version_cmp("535.54.03", "545.23.06"), Ordering::Less);
    }

    #[test]
    fn cuda_table_lookup() {
        assert_eq!(cuda_min_driver("12.4.131"), Some("550.54.14"));
        assert_eq!(cuda_min_driver("12.7"), None);
        assert_eq!(major_minor("12"), Some("12.0".into()));
    }

    #[test]
    fn table_codes_are_unique() {
        let mut ids: Vec<u16> = SKUS.iter().map(|s| s.device_id).collect();
        ids.dedup();
        assert_eq!(ids.len(), SKUS.len());
    }
}
