//! Prometheus metrics from a snapshot and its report, rendered once per snapshot (never per
//! scrape) in both formats a scraper may ask for:
//! - OpenMetrics 1.0 (prometheus-client's encoder), for `Accept: application/openmetrics-text`;
//! - the classic text format 0.0.4, derived from it, which `promtool check metrics` lints
//!   cleanly (OpenMetrics' counter family naming reads as lint errors there).
//!
//! Names follow Prometheus conventions: `phq_` prefix, snake_case, base units (celsius, watts,
//! bytes, hertz, ratio), `_total` on counters. With `metrics.dcgm_compat`, the dcgm-exporter
//! names and labels are added so NVIDIA's Grafana dashboard works unchanged.

use crate::checks::Severity;
use crate::report::{Health, Report};
use crate::snapshot::{FabricState, Nv, NvmlGpu, Snapshot};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(String, String)>;
type FGauge = Family<Labels, Gauge<f64, AtomicU64>>;
type FCounter = Family<Labels, Counter<u64>>;
type FCounterF = Family<Labels, Counter<f64, AtomicU64>>;

/// Both renderings of one snapshot's metrics.
#[derive(Debug, Clone, Default)]
pub struct Rendered {
    pub openmetrics: String,
    pub text: String,
}

struct Families {
    registry: Registry,
}

/// Unit suffixes this module's names end with, and the OpenMetrics unit each declares
/// (`# UNIT`): the unit must be the name's suffix (OpenMetrics 1.0, "Unit").
const UNITS: &[&str] = &["celsius", "bytes", "seconds", "joules", "watts", "hertz", "ratio", "lanes"];

/// `name` without its unit suffix, and the unit, when it ends with one.
fn split_unit(name: &str) -> (&str, Option<prometheus_client::registry::Unit>) {
    use prometheus_client::registry::Unit;
    for u in UNITS {
        if let Some(base) = name.strip_suffix(&format!("_{u}")) {
            let unit = match *u {
                "celsius" => Unit::Celsius,
                "bytes" => Unit::Bytes,
                "seconds" => Unit::Seconds,
                "joules" => Unit::Joules,
                other => Unit::Other(other.to_string()),
            };
            return (base, Some(unit));
        }
    }
    (name, None)
}

impl Families {
    fn register(&mut self, name: &str, help: &str, metric: impl prometheus_client::registry::Metric) {
        match split_unit(name) {
            (base, Some(unit)) => self.registry.register_with_unit(base, help, unit, metric),
            (_, None) => self.registry.register(name, help, metric),
        }
    }
    fn gauge(&mut self, name: &str, help: &str) -> FGauge {
        let f = FGauge::default();
        self.register(name, help, f.clone());
        f
    }
    fn counter(&mut self, name: &str, help: &str) -> FCounter {
        let f = FCounter::default();
        // prometheus-client appends `_total` to counter samples; register the family name.
        self.register(name.trim_end_matches("_total"), help, f.clone());
        f
    }
    fn fcounter(&mut self, name: &str, help: &str) -> FCounterF {
        let f = FCounterF::default();
        self.register(name.trim_end_matches("_total"), help, f.clone());
        f
    }
}

fn l(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// `base` with one more label.
fn plus(base: &Labels, key: &str, value: &str) -> Labels {
    let mut l = base.clone();
    l.push((key.to_string(), value.to_string()));
    l
}

/// Renders a snapshot and its report as metrics, once (the HTTP task serves the result to every
/// scrape): the agent's and NVML's families, the verdict, each GPU's families (`PER_GPU`), the
/// dcgm-exporter names when asked, and the NVSwitches' SXids.
pub fn render(s: &Snapshot, r: &Report, dcgm_compat: bool) -> Rendered {
    let mut fam = Families { registry: Registry::default() };
    agent_families(&mut fam, r);
    nvml_families(&mut fam, s);
    verdict_families(&mut fam, r);
    let per_gpu: Vec<Registered> = PER_GPU.iter().map(|f| fam.per_gpu(f)).collect();
    let hostname = s.host.hostname.clone().unwrap_or_default();
    let mut dcgm = dcgm_compat.then(|| Dcgm::new(&mut fam));
    for g in &r.gpus {
        let gpu = Gpu { report: g, nvml: s.nvml_gpu(&g.pci_address) };
        let uuid = g.uuid.clone().unwrap_or_default();
        let base = l(&[("gpu", &g.pci_address), ("uuid", &uuid)]);
        for family in &per_gpu {
            family.add(&gpu, &base);
        }
        if let (Some(d), Some(n)) = (dcgm.as_mut(), gpu.nvml) {
            d.add(n, g, &hostname, r.driver.version.as_deref().unwrap_or(""));
        }
    }
    sxid_counters(&mut fam, s);
    let mut openmetrics = String::new();
    // Writing into a String cannot fail; an encoder error would be a bug in a metric name.
    if encode(&mut openmetrics, &fam.registry).is_err() {
        openmetrics.clear();
    }
    let text = to_text_format(&openmetrics);
    if dcgm_compat {
        let (openmetrics, text) = retype_dcgm_counters(&openmetrics, &text);
        return Rendered { openmetrics, text };
    }
    Rendered { openmetrics, text }
}

/// The agent itself: its identity, what became of its events, and when the snapshot was taken.
fn agent_families(fam: &mut Families, r: &Report) {
    let info = fam.gauge("phq_agent_info", "The agent's version and id; always 1");
    info.get_or_create(&l(&[("version", &r.agent.version), ("agent_id", &r.agent.agent_id)])).set(1.0);
    if let Some(e) = &r.agent.events {
        let merged = fam.counter(
            "phq_agent_events_merged_total",
            "Xids folded into a later event's count (repeats within the Xid window)",
        );
        merged.get_or_create(&vec![]).inc_by(e.merged);
        let dropped = fam.counter(
            "phq_agent_events_dropped_total",
            "Events not spooled: the spool was at its byte bound, or the disk refused them",
        );
        dropped.get_or_create(&vec![]).inc_by(e.dropped);
        fam.gauge("phq_agent_spool_events", "Events in the spool, waiting for the platform")
            .get_or_create(&vec![])
            .set(e.spooled as f64);
        fam.gauge("phq_agent_spool_bytes", "Bytes the spool holds").get_or_create(&vec![]).set(e.spool_bytes as f64);
    }
    // When the data behind every other series was read: a collector that stopped shows as a
    // growing `time() - phq_snapshot_timestamp_seconds`, not as stale values that look fine.
    let observed = r.observed_at.0.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    fam.gauge("phq_snapshot_timestamp_seconds", "When the snapshot these metrics come from was taken (Unix time)")
        .get_or_create(&vec![])
        .set(observed);
}

/// NVML as a whole: whether it answered in time, and the driver it reports.
fn nvml_families(fam: &mut Families, s: &Snapshot) {
    // NVML answering or not: while a call is past its deadline the GPUs it was about have no
    // series at all (their readings are left out, never repeated from an older snapshot).
    if !matches!(s.nvml, crate::snapshot::NvmlStatus::NotRead(_)) {
        fam.gauge("phq_nvml_responsive", "1 when NVML answered every call of the snapshot within its deadline, else 0")
            .get_or_create(&vec![])
            .set(if s.nvml_blocked.is_empty() { 1.0 } else { 0.0 });
        let blocked = fam.gauge(
            "phq_nvml_blocked_seconds",
            "How long each NVML call past its deadline had been blocked when the snapshot was taken",
        );
        for b in &s.nvml_blocked {
            blocked
                .get_or_create(&l(&[("call", &b.call), ("gpu", b.gpu.as_deref().unwrap_or(""))]))
                .set(b.blocked_ms as f64 / 1000.0);
        }
    }
    if let crate::snapshot::NvmlStatus::Ok(n) = &s.nvml {
        let cuda =
            n.cuda_driver_version.value().map(|v| format!("{}.{}", v / 1000, (v % 1000) / 10)).unwrap_or_default();
        fam.gauge("phq_driver_info", "The NVIDIA driver and the CUDA version it offers; always 1")
            .get_or_create(&l(&[
                ("driver_version", n.driver_version.value().map(String::as_str).unwrap_or("")),
                ("cuda_driver_version", &cuda),
            ]))
            .set(1.0);
    }
}

/// The verdict: the VM's health, and each check's result.
fn verdict_families(fam: &mut Families, r: &Report) {
    let health = fam.gauge("phq_health_state", "1 for the VM's current health state, 0 for the others");
    for (name, h) in [
        ("healthy", Health::Healthy),
        ("degraded", Health::Degraded),
        ("unhealthy", Health::Unhealthy),
        ("unknown", Health::Unknown),
    ] {
        health.get_or_create(&l(&[("state", name)])).set(if r.health == h { 1.0 } else { 0.0 });
    }
    let check = fam.gauge("phq_check_status", "Each check's result: 0 pass, 1 warn, 2 fail, 3 unknown");
    for f in &r.findings {
        let v = match f.severity {
            Severity::Pass => 0.0,
            Severity::Warn => 1.0,
            Severity::Fail => 2.0,
            Severity::Unknown => 3.0,
        };
        check.get_or_create(&l(&[("check", &f.id), ("gpu", f.gpu.as_deref().unwrap_or(""))])).set(v);
    }
}

/// What a per-GPU family reads: the GPU as the report lists it, and NVML's reading of it (none
/// for a GPU NVML does not list).
struct Gpu<'a> {
    report: &'a crate::report::GpuSummary,
    nvml: Option<&'a NvmlGpu>,
}

/// One series of a per-GPU family: its labels after `gpu` and `uuid`, and its value.
type Sample<T> = (Vec<(&'static str, String)>, T);

/// How a per-GPU family's samples are read and written: a gauge set, a counter increased (by
/// whole counts, or by a quantity such as joules).
#[derive(Clone, Copy)]
enum PerGpu {
    Gauge(fn(&Gpu) -> Vec<Sample<f64>>),
    Counter(fn(&Gpu) -> Vec<Sample<u64>>),
    CounterF(fn(&Gpu) -> Vec<Sample<f64>>),
}

/// A per-GPU family once registered, with what it reads.
enum Registered {
    Gauge(FGauge, fn(&Gpu) -> Vec<Sample<f64>>),
    Counter(FCounter, fn(&Gpu) -> Vec<Sample<u64>>),
    CounterF(FCounterF, fn(&Gpu) -> Vec<Sample<f64>>),
}

impl Families {
    fn per_gpu(&mut self, (name, help, read): &(&str, &str, PerGpu)) -> Registered {
        match *read {
            PerGpu::Gauge(read) => Registered::Gauge(self.gauge(name, help), read),
            PerGpu::Counter(read) => Registered::Counter(self.counter(name, help), read),
            PerGpu::CounterF(read) => Registered::CounterF(self.fcounter(name, help), read),
        }
    }
}

impl Registered {
    /// The series this family finds for `gpu`, labelled `base` and their own labels.
    fn add(&self, gpu: &Gpu, base: &Labels) {
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
/// reads; the dcgm-exporter names follow them (`DCGM_SERIES`).
const PER_GPU: &[(&str, &str, PerGpu)] = &[
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
    (
        "phq_gpu_xid_errors_total",
        "Xid reports since boot, by code and the immediate resolution NVIDIA's Xid catalog gives it: every repeat counts",
        PerGpu::Counter(|g| {
            let own = |x: &crate::checks::xid::XidSummary| {
                vec![("xid", x.code.clone()), ("resolution", resolution_label(&x.resolution).to_string())]
            };
            g.report.xids.iter().map(|x| (own(x), x.count as u64)).collect()
        }),
    ),
    // Every GPU has this series from the first scrape, at 0 until an Xid: `increase()` then sees
    // the first one, which a series born at 1 hides.
    (
        "phq_gpu_xids_total",
        "Xid reports since boot, all codes together; 0 from the start",
        PerGpu::Counter(|g| vec![(vec![], g.report.xids.iter().fold(0u64, |a, x| a.wrapping_add(x.count as u64)))]),
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

/// The `resolution` label of an Xid counter: the catalog's immediate resolution as NVIDIA spells
/// it (`RESET_GPU`, `RESTART_APP`, …), so an alert can ask for "needs a reset" without a list of
/// codes; `none` where the catalog gives none yet, `unknown` for a code it does not list.
fn resolution_label(resolution: &str) -> &str {
    if resolution.is_empty() {
        "none"
    } else {
        resolution
    }
}

/// SXid counters per NVSwitch: the total from the first scrape (0 until an SXid, so `increase()`
/// sees the first one), and per code and the driver's severity as codes appear.
fn sxid_counters(fam: &mut Families, s: &Snapshot) {
    let total = fam.counter(
        "phq_nvswitch_sxids_total",
        "NVSwitch SXid reports since boot, all codes together; 0 from the start for every NVSwitch",
    );
    let by_code = fam.counter(
        "phq_nvswitch_sxid_errors_total",
        "NVSwitch SXid reports since boot, by code and the driver's severity (fatal, non_fatal): every repeat counts",
    );
    for sw in s.nvswitches() {
        total.get_or_create(&l(&[("nvswitch", &sw.address)])).inc_by(0);
    }
    for x in s.kernel_log.value().map(|k| k.sxids.as_slice()).unwrap_or_default() {
        let base = l(&[("nvswitch", &x.pci)]);
        total.get_or_create(&base).inc();
        let severity = if x.fatal { "fatal" } else { "non_fatal" };
        by_code.get_or_create(&plus(&plus(&base, "sxid", &x.raw_code), "severity", severity)).inc();
    }
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

/// A GPM field's value, as DCGM serves it (`collect::nvml::GPM_FIELDS`).
fn prof(n: &NvmlGpu, field: &str) -> Option<f64> {
    n.gpm.value().and_then(|g| g.values.get(field).copied())
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
    "DCGM_FI_PROF_SM_ACTIVE",
    "DCGM_FI_PROF_SM_OCCUPANCY",
    "DCGM_FI_PROF_PIPE_FP64_ACTIVE",
    "DCGM_FI_PROF_PIPE_FP32_ACTIVE",
    "DCGM_FI_PROF_PIPE_FP16_ACTIVE",
    "DCGM_FI_PROF_NVLINK_TX_BYTES",
    "DCGM_FI_PROF_NVLINK_RX_BYTES",
];

/// The dcgm-exporter names NVIDIA's Grafana dashboard (12239) reads, with its labels.
struct Dcgm {
    gauges: Vec<(&'static str, FGauge)>,
    xid: FGauge,
}

/// What each DCGM series is read from. Units are dcgm-exporter's (its CSV's help texts): MiB,
/// MHz, percent, watts, millijoules.
type Pick = fn(&NvmlGpu) -> Option<f64>;

fn nvv<T: Copy + Into<f64>>(v: &Nv<T>) -> Option<f64> {
    v.value().map(|x| (*x).into())
}

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
    fn new(f: &mut Families) -> Dcgm {
        let mut gauges = Vec::with_capacity(DCGM_SERIES.len());
        for (name, help, _) in DCGM_SERIES {
            gauges.push((*name, f.gauge(name, help)));
        }
        Dcgm { gauges, xid: f.gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.") }
    }

    fn add(&mut self, n: &NvmlGpu, g: &crate::report::GpuSummary, hostname: &str, driver: &str) {
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
fn retype_dcgm_counters(om: &str, text: &str) -> (String, String) {
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

/// OpenMetrics → Prometheus text 0.0.4: drop `# EOF` and `# UNIT`, and give counters their
/// `_total` name in `# HELP`/`# TYPE`, as the classic format expects.
pub fn to_text_format(om: &str) -> String {
    let mut counters: Vec<String> = Vec::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, "counter")) = rest.split_once(' ') {
                counters.push(name.to_string());
            }
        }
    }
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters.iter().any(|c| c == name).then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checks::testutil::healthy;

    fn rendered(dcgm: bool) -> Rendered {
        let s = healthy();
        let findings = crate::checks::run(&s, &crate::checks::Settings::default());
        let r = crate::report::build(&s, findings, "vm-1".into(), s.observed_at, 1);
        render(&s, &r, dcgm)
    }

    #[test]
    fn openmetrics_and_text_carry_the_same_samples() {
        let m = rendered(false);
        assert!(m.openmetrics.ends_with("# EOF\n"));
        assert!(!m.text.contains("# EOF"));
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples(&m.openmetrics), samples(&m.text));
        assert!(
            m.text.contains("# TYPE phq_gpu_xid_errors_total counter") || !m.text.contains("phq_gpu_xid_errors_total{")
        );
        assert!(m.text.contains("# TYPE phq_gpu_pcie_replays_total counter"));
        assert!(m.openmetrics.contains("# TYPE phq_gpu_pcie_replays counter"));
        assert!(
            m.text.contains(
                r#"phq_gpu_temperature_celsius{gpu="0000:09:00.0",uuid="GPU-3f1c0b7e-0000-4000-8000-000000000009"} 31"#
            ),
            "{}",
            m.text
        );
        assert!(m.text.contains(r#"phq_gpu_power_usage_watts{gpu="0000:09:00.0""#));
        assert!(m.text.contains(r#"phq_health_state{state="healthy"} 1"#));
    }

    #[test]
    fn every_gpu_has_its_xid_total_and_up_from_the_first_scrape() {
        let m = rendered(false);
        let zero_totals = m.text.lines().filter(|l| l.starts_with("phq_gpu_xids_total{") && l.ends_with(" 0")).count();
        assert_eq!(zero_totals, 8, "{}", m.text);
        assert_eq!(m.text.lines().filter(|l| l.starts_with("phq_gpu_up{") && l.ends_with(" 1.0")).count(), 8);
        assert!(m.text.contains("phq_snapshot_timestamp_seconds "));
        assert!(
            m.text.contains(r#"phq_driver_info{driver_version="580.82.07",cuda_driver_version="13.0"} 1.0"#),
            "{}",
            m.text
        );
        assert!(m.text.contains(r#"phq_gpu_memory_utilization_ratio{gpu="0000:09:00.0""#));
        assert!(m.text.contains(r#"index="0""#));
        // Units are declared in OpenMetrics, and dropped from the classic format.
        assert!(m.openmetrics.contains("# UNIT phq_gpu_temperature_celsius celsius"), "{}", m.openmetrics);
        assert!(m.openmetrics.contains("# UNIT phq_gpu_memory_total_bytes bytes"));
        assert!(!m.text.contains("# UNIT"));
    }

    #[test]
    fn a_lost_gpu_is_down_not_missing() {
        let mut s = healthy();
        if let crate::snapshot::NvmlStatus::Ok(n) = &mut s.nvml {
            n.devices[3].temperature_c = Nv::Error("GPU is lost".into());
            n.devices[3].memory = Nv::Error("GPU is lost".into());
            n.devices[4].temperature_c = Nv::NotSupported;
        }
        let r = crate::report::build(&s, crate::checks::run(&s, &Default::default()), "vm".into(), s.observed_at, 1);
        let m = render(&s, &r, false);
        let up = |bus: &str| {
            m.text
                .lines()
                .find(|l| l.starts_with(&format!("phq_gpu_up{{gpu=\"0000:{bus}:00.0\"")))
                .unwrap_or("")
                .to_string()
        };
        assert!(up("0c").ends_with(" 0.0"), "{}", up("0c"));
        assert!(up("0d").ends_with(" 1.0"), "unsupported is not lost: {}", up("0d"));
    }

    #[test]
    fn dcgm_names_only_when_asked() {
        assert!(!rendered(false).text.contains("DCGM_FI_DEV_GPU_TEMP"));
        let m = rendered(true);
        assert!(m.text.contains(r#"DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-3f1c0b7e-0000-4000-8000-000000000009",pci_bus_id="00000000:09:00.0",device="nvidia0",modelName="NVIDIA H100 80GB HBM3",Hostname="vm",DCGM_FI_DRIVER_VERSION="580.82.07"} 31"#), "{}", m.text);
        assert!(m.text.contains(r#"err_code="0",err_msg="No Error"} 0"#), "no Xid yet: {}", m.text);
    }

    /// Every default counter of dcgm-exporter is either served under its own name or listed
    /// with the reason it is not; and what the list says is served, is.
    #[test]
    fn dcgm_default_counters_are_covered_or_said_why_not() {
        assert_eq!(DCGM_DEFAULT_COUNTERS.len(), 26, "dcgm-exporter's etc/default-counters.csv has 26");
        let m = rendered(true);
        let served: Vec<&str> = DCGM_DEFAULT_COUNTERS.iter().filter(|(_, c)| c.is_ok()).map(|(n, _)| *n).collect();
        for name in &served {
            let present = if *name == "DCGM_FI_DRIVER_VERSION" {
                m.text.contains("DCGM_FI_DRIVER_VERSION=\"580.82.07\"")
            } else {
                m.text.lines().any(|l| l.starts_with(&format!("{name}{{")))
            };
            assert!(present, "{name} is listed as served but is not in /metrics");
        }
        for line in m.text.lines().filter(|l| l.starts_with("# TYPE DCGM_")) {
            let name = line.split_whitespace().nth(2).unwrap();
            assert!(
                served.contains(&name) || DCGM_BEYOND_DEFAULTS.contains(&name),
                "{name} is served but in neither list"
            );
        }
        for name in DCGM_BEYOND_DEFAULTS {
            assert!(m.text.lines().any(|l| l.starts_with(&format!("{name}{{"))), "{name} is listed but not served");
        }
        eprintln!("{} of {} default counters served", served.len(), DCGM_DEFAULT_COUNTERS.len());
    }

    /// dcgm-exporter serves its counters under their bare names typed `counter`; OpenMetrics
    /// would rename a counter's samples, so there they are `unknown` with the same names.
    #[test]
    fn dcgm_counters_are_counters_with_dcgm_exporters_names() {
        let m = rendered(true);
        for name in DCGM_COUNTERS {
            assert!(m.text.contains(&format!("# TYPE {name} counter\n")), "{name} in {}", m.text);
            assert!(m.openmetrics.contains(&format!("# TYPE {name} unknown\n")), "{name}");
            assert!(m.openmetrics.lines().any(|l| l.starts_with(&format!("{name}{{"))), "{name} keeps its name");
        }
        assert!(m.text.contains("# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"));
        assert!(m.openmetrics.ends_with("# EOF\n"));
    }

    /// Free memory is NVML's own figure: total − reserved − used, not total − used.
    #[test]
    fn fb_free_leaves_out_the_reservation() {
        let m = rendered(true);
        let value = |name: &str| -> String {
            let line = m.text.lines().find(|l| l.starts_with(&format!("{name}{{gpu=\"0\""))).unwrap_or_default();
            line.rsplit(' ').next().unwrap_or_default().to_string()
        };
        assert_eq!(value("DCGM_FI_DEV_FB_RESERVED"), "904.0");
        assert_eq!(value("DCGM_FI_DEV_FB_USED"), "8.0");
        assert_eq!(value("DCGM_FI_DEV_FB_FREE"), "80647.0", "81559 MiB − 904 reserved − 8 used");
        assert_eq!(value("DCGM_FI_DEV_MEMORY_TEMP"), "35.0");
        assert_eq!(value("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"), "1234567890.0");
        assert_eq!(value("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL"), "2097152.0");
        assert_eq!(value("DCGM_FI_DEV_CLOCK_THROTTLE_REASONS"), "1.0", "gpu_idle");
        assert!(m.text.contains(r#"phq_gpu_memory_reserved_bytes{gpu="0000:09:00.0""#));
        assert!(m.text.contains("# TYPE phq_gpu_energy_joules_total counter"));
        assert!(m.openmetrics.contains("# UNIT phq_gpu_energy_joules joules"));
    }

    #[test]
    fn dcgm_xid_is_the_last_one_with_its_code_and_message() {
        use crate::snapshot::{Fact, KernelLog, XidEvent};
        let mut s = healthy();
        let xid = |code: u32, usec: u64| XidEvent {
            pci: "0000:0c:00".into(),
            xid: Some(code),
            raw_code: code.to_string(),
            usec: Some(usec),
            seq: Some(usec),
            message: String::new(),
        };
        // 79 is the worst, 13 the last.
        s.kernel_log =
            Fact::Value(KernelLog { xids: vec![xid(79, 1_000_000), xid(13, 2_000_000)], ..Default::default() });
        let r = crate::report::build(&s, crate::checks::run(&s, &Default::default()), "vm".into(), s.observed_at, 1);
        let m = render(&s, &r, true);
        let line = m.text.lines().find(|l| l.starts_with("DCGM_FI_DEV_XID_ERRORS{gpu=\"3\"")).unwrap_or_default();
        assert!(line.contains(r#"err_code="13",err_msg="Graphics Engine Exception"} 13"#), "{line}");
    }

    /// Every NVSwitch has its SXid total from the first scrape; an SXid adds to it and to its
    /// code's counter, with the driver's severity; the Xid counters carry the catalog's
    /// immediate resolution.
    #[test]
    fn sxid_counters_are_born_at_zero_and_xids_carry_their_resolution() {
        let m = rendered(false);
        let zeros: Vec<&str> = m.text.lines().filter(|l| l.starts_with("phq_nvswitch_sxids_total{")).collect();
        assert_eq!(zeros.len(), 4, "{}", m.text);
        assert!(zeros.iter().all(|l| l.ends_with(" 0")), "{zeros:?}");
        assert!(!m.text.contains("phq_nvswitch_sxid_errors_total{"), "no code before the first SXid");
        let mut s = healthy();
        s.kernel_log = crate::snapshot::Fact::Value(crate::collect::kmsg::parse(
            "3,1,1,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n\
             4,2,2,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Non-fatal, Link 32 egress non-posted PRIV error (First)\n\
             4,3,3,-;nvidia-nvswitch3: SXid (PCI:0000:14:00.0): 12028, Severity 0 Engine instance 32 Sub-engine instance 00\n\
             4,4,4,-;NVRM: Xid (PCI:0000:0c:00): 46, pid=1, name=a, b\n\
             4,5,5,-;NVRM: Xid (PCI:0000:0c:00): 165, pid=1, name=a, b\n",
            "/dev/kmsg",
        ));
        let r = crate::report::build(&s, crate::checks::run(&s, &Default::default()), "vm".into(), s.observed_at, 1);
        let m = render(&s, &r, false);
        for line in [
            r#"phq_nvswitch_sxids_total{nvswitch="0000:11:00.0"} 1"#,
            r#"phq_nvswitch_sxids_total{nvswitch="0000:14:00.0"} 1"#,
            r#"phq_nvswitch_sxid_errors_total{nvswitch="0000:11:00.0",sxid="20034",severity="fatal"} 1"#,
            r#"phq_nvswitch_sxid_errors_total{nvswitch="0000:14:00.0",sxid="12028",severity="non_fatal"} 1"#,
            r#"xid="46",resolution="RESET_GPU"} 1"#,
            r#"xid="165",resolution="none"} 1"#,
        ] {
            assert!(m.text.contains(line), "{line} in {}", m.text);
        }
    }

    #[test]
    fn xid_repeats_are_counted() {
        let mut s = healthy();
        if let crate::snapshot::NvmlStatus::Ok(n) = &mut s.nvml {
            n.xid_events = vec![
                crate::snapshot::NvmlXid { gpu: "0000:0c:00.0".into(), xid: 79 },
                crate::snapshot::NvmlXid { gpu: "0000:0c:00.0".into(), xid: 79 },
            ];
        }
        let r = crate::report::build(
            &s,
            crate::checks::run(&s, &crate::checks::Settings::default()),
            "vm".into(),
            s.observed_at,
            1,
        );
        let m = render(&s, &r, false);
        assert!(m.text.contains(r#"xid="79",resolution="RESTART_BM"} 2"#), "{}", m.text);
    }
}
