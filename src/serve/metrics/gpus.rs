//! The per-GPU families: one table (`PER_GPU`), each family with its help text and what it reads
//! of a GPU — the report's summary, NVML's reading — in the order they are served.

use super::{nvv, FCounter, FCounterF, FGauge, Families, Labels};
use crate::snapshot::{FabricState, Nv, NvmlGpu};

/// What a per-GPU family reads: the GPU as the report lists it, and NVML's reading of it (none
/// for a GPU NVML does not list).
pub(super) struct Gpu<'a> {
    pub(super) report: &'a crate::report::GpuSummary,
    pub(super) nvml: Option<&'a NvmlGpu>,
}

/// One series of a per-GPU family: its labels after `gpu` and `uuid`, and its value.
type Sample<T> = (Vec<(&'static str, String)>, T);

/// How a per-GPU family's samples are read and written: a gauge set, a counter increased (by
/// whole counts, or by a quantity such as joules).
#[derive(Clone, Copy)]
pub(super) enum PerGpu {
    Gauge(fn(&Gpu) -> Vec<Sample<f64>>),
    Counter(fn(&Gpu) -> Vec<Sample<u64>>),
    CounterF(fn(&Gpu) -> Vec<Sample<f64>>),
}

/// A per-GPU family once registered, with what it reads.
pub(super) enum Registered {
    Gauge(FGauge, fn(&Gpu) -> Vec<Sample<f64>>),
    Counter(FCounter, fn(&Gpu) -> Vec<Sample<u64>>),
    CounterF(FCounterF, fn(&Gpu) -> Vec<Sample<f64>>),
}

impl Families {
    pub(super) fn per_gpu(&mut self, (name, help, read): &(&str, &str, PerGpu)) -> Registered {
        match *read {
            PerGpu::Gauge(read) => Registered::Gauge(self.gauge(name, help), read),
            PerGpu::Counter(read) => Registered::Counter(self.counter(name, help), read),
            PerGpu::CounterF(read) => Registered::CounterF(self.fcounter(name, help), read),
        }
    }
}

impl Registered {
    /// The series this family finds for `gpu`, labelled `base` and their own labels.
    pub(super) fn add(&self, gpu: &Gpu, base: &Labels) {
        let labels = |own: Vec<(&'static str, String)>| {
            let mut l = base.clone();
            l.extend(own.into_iter().map(|(k, v)| (k.to_string(), v)));
            l
        };
        match self {
            Registered::Gauge(f, read) => read(gpu).into_iter().for_each(|(own, v)| {
                f.get_or_create(&labels(own)).set(v);
            }),
            Registered::Counter(f, read) => read(gpu).into_iter().for_each(|(own, v)| {
                f.get_or_create(&labels(own)).inc_by(v);
            }),
            Registered::CounterF(f, read) => read(gpu).into_iter().for_each(|(own, v)| {
                f.get_or_create(&labels(own)).inc_by(v);
            }),
        }
    }
}

/// One series, from NVML's reading, where it has the value.
fn one<T>(g: &Gpu, pick: impl Fn(&NvmlGpu) -> Option<T>) -> Vec<Sample<T>> {
    g.nvml.and_then(pick).map(|v| (vec![], v)).into_iter().collect()
}

/// Series told apart by one label, from NVML's reading, where it has them.
fn by<T>(g: &Gpu, label: &'static str, pick: impl Fn(&NvmlGpu) -> Option<Vec<(&str, T)>>) -> Vec<Sample<T>> {
    let found = g.nvml.and_then(pick).unwrap_or_default();
    found.into_iter().map(|(v, x)| (vec![(label, v.to_string())], x)).collect()
}

fn flag(b: bool) -> f64 {
    if b {
        1.0
    } else {
        0.0
    }
}

/// The per-GPU families in the order they are served, each with its help text and what it
/// reads; the Xid counters (`XidCounters`) and the dcgm-exporter names (`DCGM_SERIES`) follow.
pub(super) const PER_GPU: &[(&str, &str, PerGpu)] = &[
    ("phq_gpu_info", "One series per GPU with its identity; always 1", PerGpu::Gauge(gpu_info)),
    ("phq_gpu_temperature_celsius", "GPU core temperature", PerGpu::Gauge(|g| one(g, |n| nvv(&n.temperature_c)))),
    (
        "phq_gpu_slowdown_temperature_celsius",
        "Temperature at which the GPU starts to slow down",
        PerGpu::Gauge(|g| one(g, |n| nvv(&n.slowdown_temperature_c))),
    ),
    (
        "phq_gpu_power_usage_watts",
        "Power draw",
        PerGpu::Gauge(|g| one(g, |n| n.power_usage_mw.value().map(|mw| *mw as f64 / 1000.0))),
    ),
    (
        "phq_gpu_power_limit_watts",
        "Enforced power limit",
        PerGpu::Gauge(|g| one(g, |n| n.power_limit_mw.value().map(|mw| *mw as f64 / 1000.0))),
    ),
    (
        "phq_gpu_memory_total_bytes",
        "Device memory",
        PerGpu::Gauge(|g| one(g, |n| n.memory.value().map(|m| m.total_bytes as f64))),
    ),
    (
        "phq_gpu_gpm_supported",
        "1 when NVML's GPM gives this GPU's profiling metrics (Hopper and later), 0 when it does not",
        PerGpu::Gauge(|g| {
            one(g, |n| match &n.gpm {
                Nv::Value(_) => Some(1.0),
                Nv::NotSupported => Some(0.0),
                Nv::Error(_) => None,
            })
        }),
    ),
    (
        "phq_gpu_gpm_activity_ratio",
        "NVML GPM: the share of the last interval each unit was active (metric: gr_engine, sm, sm_occupancy, tensor, dram, fp64, fp32, fp16)",
        PerGpu::Gauge(gpm_ratios),
    ),
    (
        "phq_gpu_gpm_bytes_per_second",
        "NVML GPM: PCIe and NVLink traffic over the last interval (bus: pcie, nvlink; direction: tx, rx)",
        PerGpu::Gauge(gpm_rates),
    ),
    (
        "phq_gpu_memory_used_bytes",
        "Device memory allocated (the driver's reservation not included)",
        PerGpu::Gauge(|g| one(g, |n| n.memory.value().map(|m| m.used_bytes as f64))),
    ),
    (
        "phq_gpu_memory_free_bytes",
        "Device memory neither allocated nor reserved, as NVML counts it",
        PerGpu::Gauge(|g| one(g, |n| n.memory.value().map(|m| m.free_bytes as f64))),
    ),
    (
        "phq_gpu_memory_reserved_bytes",
        "Device memory the driver and firmware set aside",
        PerGpu::Gauge(|g| one(g, |n| n.memory.value().map(|m| m.reserved_bytes as f64))),
    ),
    ("phq_gpu_memory_temperature_celsius", "HBM temperature", PerGpu::Gauge(|g| one(g, |n| nvv(&n.memory_temperature_c)))),
    (
        "phq_gpu_energy_joules_total",
        "Energy the GPU used since the driver loaded",
        PerGpu::CounterF(|g| one(g, |n| n.energy_mj.value().map(|mj| *mj as f64 / 1000.0))),
    ),
    (
        "phq_gpu_clock_events_seconds_total",
        "How long the clocks were held back since the driver loaded, by reason (NVML violation counters)",
        PerGpu::CounterF(|g| {
            by(g, "reason", |n| {
                n.violations_ns.value().map(|v| v.iter().map(|(r, ns)| (r.as_str(), *ns as f64 / 1e9)).collect())
            })
        }),
    ),
    (
        "phq_gpu_encoder_utilization_ratio",
        "Fraction of the sample period the video encoders were busy",
        PerGpu::Gauge(|g| one(g, |n| n.encoder_utilization.value().map(|u| *u as f64 / 100.0))),
    ),
    (
        "phq_gpu_decoder_utilization_ratio",
        "Fraction of the sample period the video decoders were busy",
        PerGpu::Gauge(|g| one(g, |n| n.decoder_utilization.value().map(|u| *u as f64 / 100.0))),
    ),
    (
        "phq_gpu_nvlink_data_bytes_total",
        "NVLink payload bytes over all links since the driver loaded, by direction",
        PerGpu::Counter(|g| {
            by(g, "direction", |n| {
                let t = n.nvlink_throughput.value()?;
                Some(vec![("tx", t.tx_kib.saturating_mul(1024)), ("rx", t.rx_kib.saturating_mul(1024))])
            })
        }),
    ),
    (
        "phq_gpu_sm_clock_hertz",
        "SM clock",
        PerGpu::Gauge(|g| one(g, |n| n.sm_clock_mhz.value().map(|c| *c as f64 * 1e6))),
    ),
    (
        "phq_gpu_memory_clock_hertz",
        "Memory clock",
        PerGpu::Gauge(|g| one(g, |n| n.mem_clock_mhz.value().map(|c| *c as f64 * 1e6))),
    ),
    (
        "phq_gpu_utilization_ratio",
        "Fraction of time a kernel ran over the last sample period",
        PerGpu::Gauge(|g| one(g, |n| n.utilization.value().map(|u| u.gpu as f64 / 100.0))),
    ),
    (
        "phq_gpu_memory_utilization_ratio",
        "Fraction of time device memory was read or written over the last sample period",
        PerGpu::Gauge(|g| one(g, |n| n.utilization.value().map(|u| u.memory as f64 / 100.0))),
    ),
    (
        "phq_gpu_up",
        "1 while NVML answers for the GPU; 0 for a GPU on the bus that it does not (fell off, lost)",
        // Down: NVML does not list it, or its basic readings fail (GPU_IS_LOST after an Xid 79).
        // A reading a VM's driver does not support is no sign of a lost GPU.
        PerGpu::Gauge(|g| {
            let answers =
                g.nvml.is_some_and(|n| !(matches!(n.temperature_c, Nv::Error(_)) && matches!(n.memory, Nv::Error(_))));
            vec![(vec![], flag(answers))]
        }),
    ),
    (
        "phq_gpu_clock_event_active",
        "1 while a clock-event (throttle) reason is active",
        PerGpu::Gauge(|g| {
            by(g, "reason", |n| {
                let reasons = n.throttle_reasons.value()?;
                let active = |name: &str| flag(reasons.iter().any(|r| r == name));
                Some(crate::collect::nvml::THROTTLE_REASONS.iter().map(|(_, name)| (*name, active(name))).collect())
            })
        }),
    ),
    (
        "phq_gpu_ecc_volatile_errors",
        "ECC errors since the last GPU reset, by type",
        PerGpu::Gauge(|g| {
            by(g, "type", |n| {
                let e = n.ecc_volatile.value()?;
                Some(vec![("corrected", e.corrected as f64), ("uncorrected", e.uncorrected as f64)])
            })
        }),
    ),
    (
        "phq_gpu_ecc_aggregate_errors_total",
        "ECC errors over the GPU's life, by type",
        PerGpu::Counter(|g| {
            by(g, "type", |n| {
                let e = n.ecc_aggregate.value()?;
                Some(vec![("corrected", e.corrected), ("uncorrected", e.uncorrected)])
            })
        }),
    ),
    (
        "phq_gpu_remapped_rows",
        "Rows remapped, by the kind of error that caused it",
        PerGpu::Gauge(|g| {
            by(g, "type", |n| {
                let rr = n.remapped_rows.value()?;
                Some(vec![("correctable", rr.correctable as f64), ("uncorrectable", rr.uncorrectable as f64)])
            })
        }),
    ),
    (
        "phq_gpu_row_remap_pending",
        "1 while a row remap waits for a GPU reset",
        PerGpu::Gauge(|g| one(g, |n| n.remapped_rows.value().map(|rr| flag(rr.pending)))),
    ),
    (
        "phq_gpu_row_remap_failure",
        "1 when a row could not be remapped",
        PerGpu::Gauge(|g| one(g, |n| n.remapped_rows.value().map(|rr| flag(rr.failure)))),
    ),
    (
        "phq_gpu_pcie_link_generation",
        "PCIe link generation, current and max",
        PerGpu::Gauge(|g| by(g, "link", |n| Some(known(&[("current", &n.pcie.gen_current), ("max", &n.pcie.gen_max)])))),
    ),
    (
        "phq_gpu_pcie_link_width_lanes",
        "PCIe link width, current and max",
        PerGpu::Gauge(|g| {
            by(g, "link", |n| Some(known(&[("current", &n.pcie.width_current), ("max", &n.pcie.width_max)])))
        }),
    ),
    (
        "phq_gpu_pcie_replays_total",
        "PCIe replays since the driver loaded",
        PerGpu::Counter(|g| one(g, |n| n.pcie.replay_counter.value().map(|c| *c as u64))),
    ),
    (
        "phq_gpu_nvlink_links_active",
        "NVLinks that are up",
        PerGpu::Gauge(|g| {
            one(g, |n| n.nvlinks.value().map(|links| links.iter().filter(|k| k.active == Nv::Value(true)).count() as f64))
        }),
    ),
    (
        "phq_gpu_nvlink_errors_total",
        "NVLink error counters summed over the GPU's links, by type",
        PerGpu::Counter(|g| {
            by(g, "type", |n| {
                let links = n.nvlinks.value()?;
                let sum = |pick: fn(&crate::snapshot::NvLinkInfo) -> &Nv<u64>| -> u64 {
                    links.iter().filter_map(|k| pick(k).value().copied()).sum()
                };
                Some(vec![
                    ("replay", sum(|k| &k.replay_errors)),
                    ("recovery", sum(|k| &k.recovery_errors)),
                    ("crc_flit", sum(|k| &k.crc_flit_errors)),
                    ("crc_data", sum(|k| &k.crc_data_errors)),
                ])
            })
        }),
    ),
    (
        "phq_gpu_fabric_state",
        "1 for the GPU's NVSwitch fabric state",
        PerGpu::Gauge(|g| {
            by(g, "state", |n| {
                let f = n.fabric.value()?;
                let states = [
                    ("not_supported", FabricState::NotSupported),
                    ("not_started", FabricState::NotStarted),
                    ("in_progress", FabricState::InProgress),
                    ("completed", FabricState::Completed),
                ];
                Some(states.into_iter().map(|(name, st)| (name, flag(f.state == st))).collect())
            })
        }),
    ),
];

/// The GPU's identity, on a series of its own.
fn gpu_info(g: &Gpu) -> Vec<Sample<f64>> {
    let r = g.report;
    let index = g.nvml.map(|n| n.index.to_string()).unwrap_or_default();
    let own = vec![
        ("index", index),
        ("model", r.model.clone()),
        ("pci_id", r.pci_id.clone()),
        ("driver", r.driver.clone().unwrap_or_default()),
        // The physical part, whatever VM it is in (issue 39): NVML's board serial; empty where
        // NVML could not read it (the report's `identity_note` says why).
        ("serial", r.serial.clone().unwrap_or_default()),
    ];
    vec![(own, 1.0)]
}

/// The readings of `pairs` NVML gave, by their label.
fn known<'a>(pairs: &[(&'a str, &Nv<u32>)]) -> Vec<(&'a str, f64)> {
    pairs.iter().filter_map(|(k, v)| Some((*k, f64::from(*v.value()?)))).collect()
}

/// NVML GPM's activity ratios, by unit.
fn gpm_ratios(g: &Gpu) -> Vec<Sample<f64>> {
    let values = g.nvml.and_then(|n| n.gpm.value()).map(|gm| gm.values.iter()).into_iter().flatten();
    values
        .filter_map(|(field, v)| match gpm_label(field) {
            Some(GpmLabel::Ratio(m)) => Some((vec![("metric", m.to_string())], *v)),
            _ => None,
        })
        .collect()
}

/// NVML GPM's traffic rates, by bus and direction.
fn gpm_rates(g: &Gpu) -> Vec<Sample<f64>> {
    let values = g.nvml.and_then(|n| n.gpm.value()).map(|gm| gm.values.iter()).into_iter().flatten();
    values
        .filter_map(|(field, v)| match gpm_label(field) {
            Some(GpmLabel::Rate(bus, dir)) => {
                Some((vec![("bus", bus.to_string()), ("direction", dir.to_string())], *v))
            }
            _ => None,
        })
        .collect()
}

/// How the agent names a GPM field (`collect::nvml::GPM_FIELDS`, by DCGM's name).
enum GpmLabel {
    Ratio(&'static str),
    Rate(&'static str, &'static str),
}

fn gpm_label(field: &str) -> Option<GpmLabel> {
    Some(match field {
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE" => GpmLabel::Ratio("gr_engine"),
        "DCGM_FI_PROF_SM_ACTIVE" => GpmLabel::Ratio("sm"),
        "DCGM_FI_PROF_SM_OCCUPANCY" => GpmLabel::Ratio("sm_occupancy"),
        "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE" => GpmLabel::Ratio("tensor"),
        "DCGM_FI_PROF_DRAM_ACTIVE" => GpmLabel::Ratio("dram"),
        "DCGM_FI_PROF_PIPE_FP64_ACTIVE" => GpmLabel::Ratio("fp64"),
        "DCGM_FI_PROF_PIPE_FP32_ACTIVE" => GpmLabel::Ratio("fp32"),
        "DCGM_FI_PROF_PIPE_FP16_ACTIVE" => GpmLabel::Ratio("fp16"),
        "DCGM_FI_PROF_PCIE_TX_BYTES" => GpmLabel::Rate("pcie", "tx"),
        "DCGM_FI_PROF_PCIE_RX_BYTES" => GpmLabel::Rate("pcie", "rx"),
        "DCGM_FI_PROF_NVLINK_TX_BYTES" => GpmLabel::Rate("nvlink", "tx"),
        "DCGM_FI_PROF_NVLINK_RX_BYTES" => GpmLabel::Rate("nvlink", "rx"),
        _ => return None,
    })
}
