//! The dcgm-exporter names (`metrics.dcgm_compat`), with dcgm-exporter's labels, help texts and
//! types, so NVIDIA's Grafana dashboards work unchanged: a table of series (`DCGM_SERIES`), each
//! with what it reads of NVML's reading of a GPU.

use super::{l, nvv, plus, FGauge, Families};
use crate::snapshot::{Nv, NvmlGpu};

/// A GPM field's value, as DCGM serves it (`collect::nvml::GPM_FIELDS`).
fn prof(n: &NvmlGpu, field: &str) -> Option<f64> {
    n.gpm.value().and_then(|g| g.values.get(field).copied())
}

/// One reason's violation time in ns, as DCGM's `DCGM_FI_DEV_*_VIOLATION` fields hold it.
fn viol(n: &NvmlGpu, reason: &str) -> Option<f64> {
    n.violations_ns.value().and_then(|v| v.get(reason)).map(|ns| *ns as f64)
}

/// dcgm-exporter's default counters (its `etc/default-counters.csv`) and what the agent does
/// with each: the name it serves it under with `metrics.dcgm_compat`, or why it does not.
/// docs/metrics.md says the same for people; a test holds the two to the rendered metrics.
pub const DCGM_DEFAULT_COUNTERS: &[(&str, Result<&str, &str>)] = &[
    ("DCGM_FI_DEV_SM_CLOCK", Ok("NVML clock info (SM)")),
    ("DCGM_FI_DEV_MEM_CLOCK", Ok("NVML clock info (memory)")),
    ("DCGM_FI_DEV_MEMORY_TEMP", Ok("NVML field NVML_FI_DEV_MEMORY_TEMP")),
    ("DCGM_FI_DEV_GPU_TEMP", Ok("NVML temperature")),
    ("DCGM_FI_DEV_POWER_USAGE", Ok("NVML power usage")),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", Ok("nvmlDeviceGetTotalEnergyConsumption")),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", Ok("NVML PCIe replay counter")),
    ("DCGM_FI_DEV_GPU_UTIL", Ok("NVML utilization (GPU)")),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", Ok("NVML utilization (memory)")),
    ("DCGM_FI_DEV_ENC_UTIL", Ok("nvmlDeviceGetEncoderUtilization")),
    ("DCGM_FI_DEV_DEC_UTIL", Ok("nvmlDeviceGetDecoderUtilization")),
    ("DCGM_FI_DEV_XID_ERRORS", Ok("the last Xid, with err_code and err_msg")),
    ("DCGM_FI_DEV_FB_FREE", Ok("NVML v2 memory info")),
    ("DCGM_FI_DEV_FB_USED", Ok("NVML v2 memory info")),
    ("DCGM_FI_DEV_FB_RESERVED", Ok("NVML v2 memory info")),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", Ok("NVML NVLink data throughput fields, TX + RX, KiB, all links")),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", Err("vGPU only; a passed-through GPU has no vGPU licence")),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", Ok("NVML remapped rows")),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", Ok("NVML remapped rows")),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", Ok("NVML remapped rows")),
    ("DCGM_FI_DRIVER_VERSION", Ok("a label on every DCGM_* series")),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", Ok("NVML GPM, as DCGM converts it")),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", Ok("NVML GPM, as DCGM converts it")),
    ("DCGM_FI_PROF_DRAM_ACTIVE", Ok("NVML GPM, as DCGM converts it")),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", Ok("NVML GPM, as DCGM converts it")),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", Ok("NVML GPM, as DCGM converts it")),
];

/// DCGM fields served beyond dcgm-exporter's defaults: the ECC and NVLink error totals its CSV
/// lists commented out, and the clock-event reasons, which NVML feeds directly.
pub const DCGM_BEYOND_DEFAULTS: &[&str] = &[
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
    "DCGM_FI_DEV_RELIABILITY_VIOLATION",
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_SM_OCCUPANCY",
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
    "DCGM_FI_PROF_NVLINK_TX_BYTES",
    "DCGM_FI_PROF_NVLINK_RX_BYTES",
];

/// The dcgm-exporter names NVIDIA's Grafana dashboard (12239) reads, with its labels.
pub(super) struct Dcgm {
    gauges: Vec<(&'static str, FGauge)>,
    xid: FGauge,
}

/// What each DCGM series is read from. Units are dcgm-exporter's (its CSV's help texts): MiB,
/// MHz, percent, watts, millijoules.
type Pick = fn(&NvmlGpu) -> Option<f64>;

fn mib(v: u64) -> f64 {
    (v >> 20) as f64
}

/// The DCGM series served, in dcgm-exporter's order, each with its help text and source.
/// Names dcgm-exporter types as counters are in `DCGM_COUNTERS`.
const DCGM_SERIES: &[(&str, &str, Pick)] = &[
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", |n| nvv(&n.sm_clock_mhz)),
    ("DCGM_FI_DEV_MEM_CLOCK", "Memory clock frequency (in MHz).", |n| nvv(&n.mem_clock_mhz)),
    ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", |n| nvv(&n.memory_temperature_c)),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", |n| nvv(&n.temperature_c)),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", |n| n.power_usage_mw.value().map(|mw| *mw as f64 / 1000.0)),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "Total energy consumption since boot (in mJ).", |n| {
        n.energy_mj.value().map(|v| *v as f64)
    }),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "Total number of PCIe retries.", |n| nvv(&n.pcie.replay_counter)),
    // Not among the defaults; dcgm-exporter's CSV carries them commented out with these help
    // texts and the counter type (etc/default-counters.csv), in DCGM's unit, ns.
    ("DCGM_FI_DEV_POWER_VIOLATION", "Throttling duration due to power constraints (in ns).", |n| viol(n, "power")),
    ("DCGM_FI_DEV_THERMAL_VIOLATION", "Throttling duration due to thermal constraints (in ns).", |n| viol(n, "thermal")),
    ("DCGM_FI_DEV_SYNC_BOOST_VIOLATION", "Throttling duration due to sync-boost constraints (in ns).", |n| {
        viol(n, "sync_boost")
    }),
    ("DCGM_FI_DEV_BOARD_LIMIT_VIOLATION", "Throttling duration due to board limit constraints (in ns).", |n| {
        viol(n, "board_limit")
    }),
    ("DCGM_FI_DEV_LOW_UTIL_VIOLATION", "Throttling duration due to low utilization (in ns).", |n| {
        viol(n, "low_utilization")
    }),
    ("DCGM_FI_DEV_RELIABILITY_VIOLATION", "Throttling duration due to reliability constraints (in ns).", |n| {
        viol(n, "reliability")
    }),
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", |n| n.utilization.value().map(|u| u.gpu as f64)),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", |n| n.utilization.value().map(|u| u.memory as f64)),
    ("DCGM_FI_DEV_ENC_UTIL", "Encoder utilization (in %).", |n| nvv(&n.encoder_utilization)),
    ("DCGM_FI_DEV_DEC_UTIL", "Decoder utilization (in %).", |n| nvv(&n.decoder_utilization)),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", |n| n.memory.value().map(|m| mib(m.free_bytes))),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", |n| n.memory.value().map(|m| mib(m.used_bytes))),
    ("DCGM_FI_DEV_FB_RESERVED", "Framebuffer memory reserved (in MiB).", |n| {
        n.memory.value().map(|m| mib(m.reserved_bytes))
    }),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "Total number of NVLink bandwidth counters for all lanes.", |n| {
        n.nvlink_throughput.value().map(|t| t.tx_kib.saturating_add(t.rx_kib) as f64)
    }),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors", |n| {
        n.remapped_rows.value().map(|r| r.uncorrectable as f64)
    }),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors", |n| {
        n.remapped_rows.value().map(|r| r.correctable as f64)
    }),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether remapping of rows has failed", |n| {
        n.remapped_rows.value().map(|r| if r.failure { 1.0 } else { 0.0 })
    }),
    // Profiling, from NVML's GPM (Hopper and later), with dcgm-exporter's help texts.
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "Ratio of time the graphics engine is active.", |n| {
        prof(n, "DCGM_FI_PROF_GR_ENGINE_ACTIVE")
    }),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "Ratio of cycles the tensor (HMMA) pipe is active.", |n| {
        prof(n, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE")
    }),
    (
        "DCGM_FI_PROF_DRAM_ACTIVE",
        "Ratio of cycles the device memory interface is active sending or receiving data.",
        |n| prof(n, "DCGM_FI_PROF_DRAM_ACTIVE"),
    ),
    (
        "DCGM_FI_PROF_PCIE_TX_BYTES",
        "The rate of data transmitted over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        |n| prof(n, "DCGM_FI_PROF_PCIE_TX_BYTES"),
    ),
    (
        "DCGM_FI_PROF_PCIE_RX_BYTES",
        "The rate of data received over the PCIe bus - including both protocol headers and data payloads - in bytes per second.",
        |n| prof(n, "DCGM_FI_PROF_PCIE_RX_BYTES"),
    ),
    // Beyond the defaults: the fields dcgm-exporter's CSV lists commented out, which NVML
    // feeds and which alerts are commonly built on.
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", |n| {
        n.ecc_volatile.value().map(|e| e.corrected as f64)
    }),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", |n| {
        n.ecc_volatile.value().map(|e| e.uncorrected as f64)
    }),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors.", |n| {
        n.ecc_aggregate.value().map(|e| e.corrected as f64)
    }),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors.", |n| {
        n.ecc_aggregate.value().map(|e| e.uncorrected as f64)
    }),
    ("DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL", "Total number of NVLink flow-control CRC errors.", |n| {
        nvlink_sum(n, |k| &k.crc_flit_errors)
    }),
    ("DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL", "Total number of NVLink data CRC errors.", |n| {
        nvlink_sum(n, |k| &k.crc_data_errors)
    }),
    ("DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL", "Total number of NVLink retries.", |n| {
        nvlink_sum(n, |k| &k.replay_errors)
    }),
    ("DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL", "Total number of NVLink recovery errors.", |n| {
        nvlink_sum(n, |k| &k.recovery_errors)
    }),
    (
        "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
        "Current clock throttle reasons (bitmask of NVML's clocks-event reasons).",
        |n| n.throttle_reasons.value().map(|names| crate::collect::nvml::throttle_bits(names) as f64),
    ),
    ("DCGM_FI_PROF_SM_ACTIVE", "The ratio of cycles an SM has at least 1 warp assigned.", |n| {
        prof(n, "DCGM_FI_PROF_SM_ACTIVE")
    }),
    ("DCGM_FI_PROF_SM_OCCUPANCY", "The ratio of number of warps resident on an SM.", |n| {
        prof(n, "DCGM_FI_PROF_SM_OCCUPANCY")
    }),
    ("DCGM_FI_PROF_PIPE_FP64_ACTIVE", "Ratio of cycles the fp64 pipes are active.", |n| {
        prof(n, "DCGM_FI_PROF_PIPE_FP64_ACTIVE")
    }),
    ("DCGM_FI_PROF_PIPE_FP32_ACTIVE", "Ratio of cycles the fp32 pipes are active.", |n| {
        prof(n, "DCGM_FI_PROF_PIPE_FP32_ACTIVE")
    }),
    ("DCGM_FI_PROF_PIPE_FP16_ACTIVE", "Ratio of cycles the fp16 pipes are active.", |n| {
        prof(n, "DCGM_FI_PROF_PIPE_FP16_ACTIVE")
    }),
    (
        "DCGM_FI_PROF_NVLINK_TX_BYTES",
        "The rate of data transmitted over NVLink, not including protocol headers, in bytes per second.",
        |n| prof(n, "DCGM_FI_PROF_NVLINK_TX_BYTES"),
    ),
    (
        "DCGM_FI_PROF_NVLINK_RX_BYTES",
        "The rate of data received over NVLink, not including protocol headers, in bytes per second.",
        |n| prof(n, "DCGM_FI_PROF_NVLINK_RX_BYTES"),
    ),
];

/// dcgm-exporter's counters (its CSV's type column) among `DCGM_SERIES`: typed `counter` in the
/// classic text format, as dcgm-exporter serves them. OpenMetrics requires a counter's samples
/// to end in `_total`, which would rename them, so there they are `unknown`, which keeps
/// the names a dashboard asks for.
pub const DCGM_COUNTERS: &[&str] = &[
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER",
    "DCGM_FI_DEV_POWER_VIOLATION",
    "DCGM_FI_DEV_THERMAL_VIOLATION",
    "DCGM_FI_DEV_SYNC_BOOST_VIOLATION",
    "DCGM_FI_DEV_BOARD_LIMIT_VIOLATION",
    "DCGM_FI_DEV_LOW_UTIL_VIOLATION",
    "DCGM_FI_DEV_RELIABILITY_VIOLATION",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
    "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
    "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    "DCGM_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
];

fn nvlink_sum(n: &NvmlGpu, pick: fn(&crate::snapshot::NvLinkInfo) -> &Nv<u64>) -> Option<f64> {
    n.nvlinks.value().map(|links| links.iter().filter_map(|k| pick(k).value().copied()).sum::<u64>() as f64)
}

/// NVML's form of a PCI address, as dcgm-exporter's `pci_bus_id` carries it: an 8-digit domain,
/// upper-case hex (`0000:0a:00.0` → `00000000:0A:00.0`).
fn nvml_bus_id(pci: &str) -> String {
    match pci.split_once(':') {
        Some((domain, rest)) => format!("{:0>8}:{}", domain.to_ascii_uppercase(), rest.to_ascii_uppercase()),
        None => pci.to_ascii_uppercase(),
    }
}

impl Dcgm {
    pub(super) fn new(f: &mut Families) -> Dcgm {
        let mut gauges = Vec::with_capacity(DCGM_SERIES.len());
        for (name, help, _) in DCGM_SERIES {
            gauges.push((*name, f.gauge(name, help)));
        }
        Dcgm { gauges, xid: f.gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.") }
    }

    pub(super) fn add(&mut self, n: &NvmlGpu, g: &crate::report::GpuSummary, hostname: &str, driver: &str) {
        let idx = n.index.to_string();
        let device = format!("nvidia{}", n.index);
        // As dcgm-exporter labels them: NVML's index, bus id and device name.
        let uuid = g.uuid.clone().unwrap_or_default();
        let bus_id = nvml_bus_id(&g.pci_address);
        let model = n.name.value().cloned().unwrap_or_else(|| g.model.clone());
        let labels = l(&[
            ("gpu", &idx),
            ("UUID", &uuid),
            ("pci_bus_id", &bus_id),
            ("device", &device),
            ("modelName", &model),
            ("Hostname", hostname),
            ("DCGM_FI_DRIVER_VERSION", driver),
        ]);
        for ((_, family), (_, _, pick)) in self.gauges.iter().zip(DCGM_SERIES) {
            if let Some(v) = pick(n) {
                family.get_or_create(&labels).set(v);
            }
        }
        // The last Xid seen (by its last report's time), not the worst, as dcgm-exporter's
        // gauge holds DCGM's last value; 0 with "No Error" before any.
        let last =
            g.xids.iter().max_by(|a, b| a.last_seen_s.partial_cmp(&b.last_seen_s).unwrap_or(std::cmp::Ordering::Equal));
        // err_msg: the catalog's description (NVIDIA's own words for the code, as DCGM's).
        let (code, msg) = match last {
            Some(x) => (
                x.code.clone(),
                x.code.parse().ok().and_then(crate::checks::xid::xid).map_or("Unknown Error", |e| e.description),
            ),
            None => ("0".to_string(), "No Error"),
        };
        let xid_labels = plus(&plus(&labels, "err_code", &code), "err_msg", msg);
        self.xid.get_or_create(&xid_labels).set(code.parse::<f64>().unwrap_or(0.0));
    }
}

/// Types dcgm-exporter's counters as it does: `counter` in the classic format (`text`), and
/// `unknown` in OpenMetrics (`om`), where a counter's samples must end in `_total`.
pub(super) fn retype_dcgm_counters(om: &str, text: &str) -> (String, String) {
    let retype = |body: &str, to: &str| -> String {
        let mut out = String::with_capacity(body.len());
        for line in body.lines() {
            let name = line.strip_prefix("# TYPE ").and_then(|r| r.strip_suffix(" gauge"));
            match name {
                Some(n) if DCGM_COUNTERS.contains(&n) => {
                    out.push_str("# TYPE ");
                    out.push_str(n);
                    out.push(' ');
                    out.push_str(to);
                }
                _ => out.push_str(line),
            }
            out.push('\n');
        }
        out
    };
    (retype(om, "unknown"), retype(text, "counter"))
}
