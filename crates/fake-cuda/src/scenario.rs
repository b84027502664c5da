//! The scenario file (docs/fake-cuda-scenario.md): the GPUs CUDA sees, how fast each path is,
//! which pairs may reach each other, and what goes wrong. Unknown fields are refused so that a
//! typo fails loudly instead of silently testing the default.

use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    /// `cuDriverGetVersion`: 12080 is CUDA 12.8.
    #[serde(default = "default_driver_version")]
    pub driver_version: i32,
    /// Makes `cuInit` fail with this code (`CUDA_ERROR_SYSTEM_NOT_READY` while the fabric
    /// manager has not set up the NVSwitch fabric, `CUDA_ERROR_NO_DEVICE`, …).
    pub init_error: Option<String>,
    pub devices: Vec<Device>,
    /// Peer access between every pair of GPUs unless `pairs` says otherwise.
    #[serde(default)]
    pub peers: Peers,
    /// How kernels run: `auto` (the PTX interpreter for small launches, the models for big
    /// ones), `interpret` (every launch through the PTX) or `model`.
    #[serde(default)]
    pub kernels: Path,
    /// What the fake NCCL (`nccl`) needs beyond the peer links.
    #[serde(default)]
    pub nccl: Option<Nccl>,
    /// A kernel that never finishes, or a synchronisation that never returns (`hang.rs`).
    #[serde(default)]
    pub hang: Option<Hang>,
    /// The cuBLAS this library also stands for (`blas.rs`): its version, and the driver it needs.
    #[serde(default)]
    pub cublas: Cublas,
}

/// `{"version": "12.9.1", "needs_driver_version": 12090}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cublas {
    /// What `cublasGetProperty` reports, major.minor.patch.
    #[serde(default = "default_cublas_version")]
    pub version: String,
    /// The oldest driver (`cuDriverGetVersion`) the CUDA runtime inside this cuBLAS starts on;
    /// absent: any. On an older one `cublasCreate_v2` answers CUBLAS_STATUS_NOT_INITIALIZED
    /// (`blas.rs` cites why).
    #[serde(default)]
    pub needs_driver_version: Option<i32>,
}

impl Default for Cublas {
    fn default() -> Self {
        Cublas { version: default_cublas_version(), needs_driver_version: None }
    }
}

/// cuBLAS 12.8.4: the one CUDA 12.8 (the default driver's version) ships.
fn default_cublas_version() -> String {
    "12.8.4".into()
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Nccl {
    /// Bus bandwidth of an all-reduce by NVLink SHARP on the NVSwitches, GB/s; absent: no NVLS
    /// (the ring's slowest link sets the rate).
    #[serde(default)]
    pub nvls_busbw_gbps: Option<f64>,
    /// The oldest driver (`cuDriverGetVersion`) the CUDA runtime NCCL is built with starts on;
    /// absent: any. On an older one `ncclCommInitAll` fails (`nccl.rs` cites why).
    #[serde(default)]
    pub needs_driver_version: Option<i32>,
}

/// `{"kernel": "memtest_fill"}`: that entry, once launched, never finishes; `{"synchronize":
/// "cuStreamSynchronize"}`: that function never returns.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hang {
    pub kernel: Option<String>,
    pub synchronize: Option<String>,
}

fn default_driver_version() -> i32 {
    12080
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// `cuDeviceGetName`, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// `0000:18:00.0` (`cuDeviceGetPCIBusId` answers in this form).
    pub pci_bus_id: String,
    /// PCI device id, e.g. 0x2330 (`CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID` is the *bus-relative*
    /// device number, not this; it is here for the scenario's reader).
    #[serde(default)]
    pub pci_device_id: Option<String>,
    pub memory_bytes: u64,
    /// What a context takes from the GPU's memory (the real driver's primary context reserves
    /// a few hundred MiB: `nvidia-smi` lists the process with that much).
    #[serde(default = "default_context_bytes")]
    pub context_bytes: u64,
    /// Rank in CUDA's default enumeration, `CUDA_DEVICE_ORDER=FASTEST_FIRST` (0 = first).
    /// Absent: PCI order. With `CUDA_DEVICE_ORDER=PCI_BUS_ID` this is ignored.
    pub fastest_first_rank: Option<usize>,
    /// Host→device copy rate from pinned memory, GB/s (10^9 bytes per second).
    pub h2d_gbps: f64,
    /// Device→host copy rate into pinned memory, GB/s.
    pub d2h_gbps: f64,
    /// HBM traffic rate, GB/s: a device-to-device copy of N bytes reads N and writes N, so it
    /// takes 2·N ÷ this.
    pub hbm_gbps: f64,
    /// HBM traffic rate of a copy kernel on the SMs (`phq_copy_sm`), GB/s read + written;
    /// absent: `hbm_gbps`.
    #[serde(default)]
    pub sm_copy_gbps: Option<f64>,
    /// What one dependent load of page-locked host memory costs a kernel, ns (`phq_chase`). The
    /// defaults here and below are the fake's own round figures, not measurements.
    #[serde(default = "default_host_latency_ns")]
    pub host_latency_ns: f64,
    /// One dependent load of the GPU's own memory, ns.
    #[serde(default = "default_hbm_latency_ns")]
    pub hbm_latency_ns: f64,
    /// The L2's size, bytes (`CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE`); 0: no cache. Default: the
    /// H100's 50 MB (NVIDIA H100 Tensor Core GPU Architecture whitepaper, "H100 L2 cache"), as
    /// the driver reports it, 50 MiB.
    #[serde(default = "default_l2_bytes")]
    pub l2_bytes: u64,
    /// One dependent load served by the L2 of the GPU owning the memory, ns.
    #[serde(default = "default_l2_latency_ns")]
    pub l2_latency_ns: f64,
    /// FP32 GEMM rate of the agent's own PTX GEMM (`phq_sgemm`), TFLOP/s; absent:
    /// `PTX_SGEMM_SHARE` of `sgemm_tflops`, the share an H200 gave it.
    #[serde(default)]
    pub ptx_sgemm_tflops: Option<f64>,
    /// Entries `[row, column]` of every GEMM product (cuBLAS's or the PTX kernel's) that this
    /// GPU computes 1.0 too large: a faulty GPU, the scenario's own fault.
    #[serde(default)]
    pub gemm_wrong_entries: Vec<[usize; 2]>,
    /// Dense BF16 rate of the agent's tensor-core kernel (`phq_mma_gemm`), TFLOP/s; the default
    /// is what it ran at on an H200 (the agent's docs/hardware-validation.md, 2026-12-04).
    #[serde(default = "default_mma_tflops")]
    pub mma_tflops: f64,
    /// Dense 16-bit tensor-core rate of cuBLAS's `cublasGemmEx` (BF16 or FP16 in, FP32 out),
    /// TFLOP/s; the default is the fake's own round figure, not a measurement.
    #[serde(default = "default_tensor_tflops")]
    pub tensor_tflops: f64,
    /// FP32 GEMM rate of cuBLAS SGEMM, TFLOP/s.
    #[serde(default = "default_sgemm_tflops")]
    pub sgemm_tflops: f64,
    /// FP64 GEMM rate of cuBLAS DGEMM, TFLOP/s; absent: `sgemm_tflops` (on Hopper the FP64
    /// tensor cores match the FP32 units: NVIDIA H100 datasheet, SXM "FP64 Tensor Core 67
    /// teraFLOPS", "FP32 67 teraFLOPS"; PCIe 51 and 51).
    #[serde(default)]
    pub dgemm_tflops: Option<f64>,
    /// FP64 rate of the agent's own `phq_dgemm` (plain FMA units, no tensor cores), TFLOP/s;
    /// absent: a quarter of the DGEMM rate (the fake's guess: `phq_dgemm` has not run on a GPU yet).
    #[serde(default)]
    pub ptx_dgemm_tflops: Option<f64>,
    /// Watts the board draws under a sustained GEMM load (`power.rs`); absent: its enforced power
    /// limit, as a healthy board held at its limit does. Below DCGM's target: a weak power stage.
    #[serde(default)]
    pub power_under_load_w: Option<f64>,
    /// `CU_DEVICE_ATTRIBUTE_COMPUTE_MODE`: default, exclusive_process or prohibited.
    #[serde(default)]
    pub compute_mode: ComputeMode,
    /// Another process holds a context on this GPU (what matters in exclusive-process mode).
    #[serde(default)]
    pub other_process: bool,
    #[serde(default)]
    pub faults: Vec<Fault>,
    /// Bits of this GPU's memory that read back as a fixed value whatever is written.
    #[serde(default)]
    pub stuck_bits: Vec<StuckBit>,
    /// Bits shorted to a bit of another cell: they read what that cell's bit holds (a bridging
    /// coupling fault). Seen only by the memory-test kernels' checks.
    #[serde(default)]
    pub coupled_bits: Vec<CoupledBit>,
}

impl Device {
    /// cuBLAS DGEMM's rate (`dgemm_tflops`).
    pub fn dgemm_tflops(&self) -> f64 {
        self.dgemm_tflops.unwrap_or(self.sgemm_tflops)
    }
    /// `phq_dgemm`'s rate (`ptx_dgemm_tflops`).
    pub fn ptx_dgemm_tflops(&self) -> f64 {
        self.ptx_dgemm_tflops.unwrap_or(self.dgemm_tflops() / 4.0)
    }
}

fn default_host_latency_ns() -> f64 {
    1000.0
}

fn default_hbm_latency_ns() -> f64 {
    600.0
}

fn default_l2_bytes() -> u64 {
    50 << 20
}

fn default_l2_latency_ns() -> f64 {
    200.0
}

fn default_peer_latency_ns() -> f64 {
    1000.0
}

fn default_context_bytes() -> u64 {
    512 << 20
}

fn default_tensor_tflops() -> f64 {
    700.0
}

fn default_mma_tflops() -> f64 {
    19.6
}

/// `phq_sgemm`'s rate over cuBLAS SGEMM's on an H200: 8.1 against 50.9 TFLOP/s (the agent's
/// docs/hardware-validation.md, 2026-12-04).
pub const PTX_SGEMM_SHARE: f64 = 8.1 / 50.9;

/// How a launch runs: through the PTX interpreter (`interp`), which executes the text the
/// module carries, or through the kernel's Rust model (`kernels`' functions), which is fast
/// enough for the 80 GB buffers of the probe scenarios. A differential test holds every model
/// to the PTX (`tests_ptx`): a model that differs is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// The interpreter for a launch of at most `kernels::INTERPRET_BUDGET` thread-instructions
    /// (by the model's estimate) and for any kernel without a model; the model otherwise.
    #[default]
    Auto,
    /// Every launch through the interpreter.
    Interpret,
    /// Every launch with a model through it.
    Model,
}

fn default_sgemm_tflops() -> f64 {
    50.0
}

#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum ComputeMode {
    #[default]
    Default,
    ExclusiveProcess,
    Prohibited,
}

/// An error the GPU raises on its `after`-th operation of kind `on` (counting from 0).
#[derive(Debug, Deserialize, Clone)]
#[serde(deny_unknown_fields)]
pub struct Fault {
    pub on: FaultOn,
    #[serde(default)]
    pub after: u64,
    /// A `CUresult` name, e.g. `CUDA_ERROR_ECC_UNCORRECTABLE`.
    pub error: String,
}

#[derive(Debug, Deserialize, Clone, Copy, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum FaultOn {
    Alloc,
    Memset,
    Memcpy,
    Gemm,
    Any,
}

/// A bit at `offset` bytes into the GPU's memory (its first allocation starts at offset 0)
/// that always reads `value`.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub struct StuckBit {
    pub offset: u64,
    pub bit: u8,
    pub value: u8,
}

/// Bit `bit` of the byte at `offset` (from the GPU's first allocation) reads bit `bit` of the
/// byte at `aggressor`, whatever was written to it: two cells shorted together. Solid patterns
/// write both alike and cannot see it; patterns that give the two cells different values can.
#[derive(Debug, Deserialize, Clone, Copy)]
#[serde(deny_unknown_fields)]
pub struct CoupledBit {
    pub offset: u64,
    pub bit: u8,
    pub aggressor: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Peers {
    /// `cuDeviceCanAccessPeer` for pairs not in `pairs`.
    #[serde(default)]
    pub access: bool,
    /// Direct peer copy rate for pairs not in `pairs`, GB/s.
    #[serde(default)]
    pub gbps: f64,
    /// One dependent load of a peer's memory, ns (`phq_chase`), for every pair.
    #[serde(default = "default_peer_latency_ns")]
    pub latency_ns: f64,
    /// Whether pairs not in `pairs` are joined by NVLink (NCCL's topology: a path of type NVL),
    /// whatever their peer access says.
    #[serde(default)]
    pub nvlink: bool,
    #[serde(default)]
    pub pairs: Vec<Pair>,
}

impl Default for Peers {
    fn default() -> Self {
        Peers { access: false, gbps: 0.0, latency_ns: default_peer_latency_ns(), nvlink: false, pairs: Vec::new() }
    }
}

/// One direction between two GPUs, by their index in `devices`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Pair {
    pub src: usize,
    pub dst: usize,
    #[serde(default = "yes")]
    pub access: bool,
    pub gbps: Option<f64>,
    /// Joined by NVLink (default: `Peers::nvlink`).
    #[serde(default)]
    pub nvlink: Option<bool>,
    /// Peer access is reported, but writes through the peer mapping never land (a PCIe path:
    /// ACS governs PCIe routing, not NVLink): PCIe Access
    /// Control Services redirecting P2P to an IOMMU that drops it (NCCL's troubleshooting guide,
    /// "PCI Access Control Services (ACS)": with ACS on, P2P "can result in a hang or low
    /// performance"; NVIDIA/nccl#2079, where P2P traffic forced through the IOMMU deadlocked
    /// `ncclAllReduce`; NVIDIA/nccl#257, cured by `intel_iommu=off`). A copy over it leaves the
    /// destination as it was; NCCL waits for ever on a ring through it.
    #[serde(default)]
    pub lost: bool,
}

fn yes() -> bool {
    true
}

impl Scenario {
    /// Whether `src` may access `dst`'s memory, and at what rate.
    pub fn peer(&self, src: usize, dst: usize) -> (bool, f64) {
        match self.peers.pairs.iter().find(|p| p.src == src && p.dst == dst) {
            Some(p) => (p.access, p.gbps.unwrap_or(self.peers.gbps)),
            None => (self.peers.access, self.peers.gbps),
        }
    }

    /// Whether `src` and `dst` are joined by NVLink.
    pub fn nvlink(&self, src: usize, dst: usize) -> bool {
        match self.peers.pairs.iter().find(|p| p.src == src && p.dst == dst) {
            Some(Pair { nvlink: Some(n), .. }) => *n,
            _ => self.peers.nvlink,
        }
    }

    /// Whether writes from `src` through its peer mapping of `dst` are lost (`Pair::lost`).
    pub fn lost(&self, src: usize, dst: usize) -> bool {
        self.peers.pairs.iter().any(|p| p.src == src && p.dst == dst && p.lost)
    }

    /// `CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED` ("Device supports switch multicast and
    /// reduction operations", DRV, `CUdevice_attribute`): the scenario's GPUs have it where the
    /// scenario gives NVLink SHARP a rate, for NVLS is those operations.
    pub fn multicast(&self) -> bool {
        self.nccl.as_ref().is_some_and(|n| n.nvls_busbw_gbps.is_some())
    }
}
