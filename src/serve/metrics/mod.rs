//! Prometheus metrics from a snapshot and its report, rendered once per snapshot (never per
//! scrape) in both formats a scraper may ask for:
//! - OpenMetrics 1.0 (prometheus-client's encoder), for `Accept: application/openmetrics-text`;
//! - the classic text format 0.0.4, derived from it, which `promtool check metrics` lints
//!   cleanly (OpenMetrics' counter family naming reads as lint errors there).
//!
//! Names follow Prometheus conventions: `phq_` prefix, snake_case, base units (celsius, watts,
//! bytes, hertz, ratio), `_total` on counters. With `metrics.dcgm_compat`, the dcgm-exporter
//! names and labels are added so NVIDIA's Grafana dashboard works unchanged.
//!
//! Here: the families of the agent, of NVML as a whole, of the verdict and of the NVSwitches, and
//! the two formats; the per-GPU families are a table in `gpus.rs`, the dcgm-exporter names one in
//! `dcgm.rs`.

mod dcgm;
mod gpus;

pub use dcgm::{DCGM_BEYOND_DEFAULTS, DCGM_COUNTERS, DCGM_DEFAULT_COUNTERS};

use crate::checks::Severity;
use crate::report::{Health, Report};
use crate::snapshot::{Nv, Snapshot};
use dcgm::{retype_dcgm_counters, Dcgm};
use gpus::{Gpu, Registered, PER_GPU};
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

/// A reading NVML gave, as a sample value.
fn nvv<T: Copy + Into<f64>>(v: &Nv<T>) -> Option<f64> {
    v.value().map(|x| (*x).into())
}

/// `base` with one more label.
fn plus(base: &Labels, key: &str, value: &str) -> Labels {
    let mut l = base.clone();
    l.push((key.to_string(), value.to_string()));
    l
}

/// Renderings and compressions made in this process: a snapshot adds at most three (`render` at
/// its first scrape, `gzip` of each format at its first gzip scrape; `serve::Metrics`), and a
/// later scrape of the same snapshot adds none. The test that scrapes one snapshot many times
/// reads it.
static RENDERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times `render` and `gzip` have run in this process.
pub fn renders() -> u64 {
    RENDERS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A rendering gzipped, at most once per snapshot, for scrapers that send `Accept-Encoding: gzip` (as
/// Prometheus does); into memory, which cannot fail short of allocation.
pub fn gzip(body: &[u8]) -> Vec<u8> {
    use std::io::Write;
    RENDERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut e = flate2::write::GzEncoder::new(Vec::with_capacity(body.len() / 8), flate2::Compression::default());
    e.write_all(body).and_then(|()| e.finish()).unwrap_or_default()
}

/// Renders a snapshot and its report as metrics, once, at the snapshot's first scrape (the HTTP
/// task serves the result to every later one): the agent's and NVML's families, the verdict, each GPU's families (`PER_GPU`), the
/// dcgm-exporter names when asked, and the NVSwitches' SXids.
pub fn render(s: &Snapshot, r: &Report, dcgm_compat: bool) -> Rendered {
    RENDERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut fam = Families { registry: Registry::default() };
    agent_families(&mut fam, r);
    nvml_families(&mut fam, s);
    verdict_families(&mut fam, r);
    let per_gpu: Vec<Registered> = PER_GPU.iter().map(|f| fam.per_gpu(f)).collect();
    let hostname = s.host.hostname.clone().unwrap_or_default();
    let xids = XidCounters::new(&mut fam);
    let mut dcgm = dcgm_compat.then(|| Dcgm::new(&mut fam));
    for g in &r.gpus {
        let gpu = Gpu { report: g, nvml: s.nvml_gpu(&g.pci_address) };
        let uuid = g.uuid.clone().unwrap_or_default();
        let base = l(&[("gpu", &g.pci_address), ("uuid", &uuid)]);
        for family in &per_gpu {
            family.add(&gpu, &base);
        }
        xids.add(g, &base);
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
    // The one series a platform routes on (issue 39): the report's verdict, 1; no other
    // combination is present, so `phq_verdict{owner="platform"}` selects the VMs waiting on it.
    // `basis` is what backs it, as `/v1/status` says (issue 51): the sorted values of
    // `report::BASES` it rests on joined by `+` ("" with no action), at most 31 combinations.
    let verdict = fam.gauge(
        "phq_verdict",
        "The most urgent action over all findings, whose move it is and what backs it (docs/checks.md); always 1",
    );
    let basis: Vec<&str> =
        r.verdict.basis.iter().map(String::as_str).filter(|b| crate::report::BASES.contains(b)).collect();
    let basis = basis.join("+");
    verdict
        .get_or_create(&l(&[("action", r.verdict.action.word()), ("owner", r.verdict.owner.word()), ("basis", &basis)]))
        .set(1.0);
}

/// Xid counters per GPU, from the report: the total from the first scrape, and per code and
/// the catalog's resolution as codes appear. Counters of events, declared here, by name.
struct XidCounters {
    by_code: FCounter,
    total: FCounter,
}

impl XidCounters {
    fn new(fam: &mut Families) -> XidCounters {
        let by_code = fam.counter(
            "phq_gpu_xid_errors_total",
            "Xid reports since boot, by code and the immediate resolution NVIDIA's Xid catalog gives it: every repeat counts",
        );
        // Every GPU has this series from the first scrape, at 0 until an Xid: `increase()` then
        // sees the first one, which a series born at 1 hides.
        let total = fam.counter("phq_gpu_xids_total", "Xid reports since boot, all codes together; 0 from the start");
        XidCounters { by_code, total }
    }

    fn add(&self, g: &crate::report::GpuSummary, base: &Labels) {
        let total = self.total.get_or_create(base);
        for x in &g.xids {
            let labels = plus(&plus(base, "xid", &x.code), "resolution", resolution_label(&x.resolution));
            self.by_code.get_or_create(&labels).inc_by(x.count as u64);
            total.inc_by(x.count as u64);
        }
    }
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
