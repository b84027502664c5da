//! Thermals and power, per GPU from NVML: gpu.throttle (clock-event reasons), gpu.temperature and
//! gpu.power-limit. Thresholds come from `facts`.

use super::{missing, Finding};
use crate::facts::{self, ThrottleClass};
use crate::snapshot::{Nv, NvmlGpu, Snapshot};

pub(super) fn throttle(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.throttle";
    let reasons = match &g.throttle_reasons {
        Nv::Value(r) => r,
        other => return missing(ID, "clock-event reasons", other),
    };
    let class = |r: &str| {
        facts::THROTTLE_SEVERITY.iter().find(|(n, _)| *n == r).map(|(_, c)| *c).unwrap_or(ThrottleClass::Warn)
    };
    let worst = reasons.iter().map(|r| class(r)).max().unwrap_or(ThrottleClass::Normal);
    let active: Vec<&str> = reasons.iter().filter(|r| class(r) > ThrottleClass::Normal).map(String::as_str).collect();
    let f = match worst {
        ThrottleClass::Fail => Finding::fail(ID, format!("clocks held down by {}", active.join(", ")))
            .detail("Hardware slowdown halves (or worse) the GPU's clocks: the cooling or power delivery of the host is failing, or the GPU is far over temperature.")
            .remedy("Report the GPU and the reason to the platform (host cooling/power); move the workload meanwhile. See gpu.temperature."),
        ThrottleClass::Warn => Finding::warn(ID, format!("clocks reduced by {}", active.join(", ")))
            .remedy("The GPU is running hot enough for the driver to slow it: check gpu.temperature and report persistent throttling to the platform."),
        ThrottleClass::Normal => Finding::pass(ID, if reasons.is_empty() { "no clock-event reason active".to_string() } else { format!("only normal reasons: {}", reasons.join(", ")) }),
    };
    f.evidence("reasons", reasons)
}

/// gpu.throttle-time: how long the clocks were held back, per reason, since the driver loaded
/// (NVML's violation counters, DCGM's `DCGM_FI_DEV_*_VIOLATION`), as a share of the time since
/// boot. A snapshot of the current reasons (`gpu.throttle`) misses every slowdown between two
/// snapshots; the counters do not.
pub(super) fn throttle_time(s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.throttle-time";
    let v = match &g.violations_ns {
        Nv::Value(v) => v,
        other => return missing(ID, "clock violation counters", other),
    };
    let Some(uptime) = s.host.uptime_s.filter(|u| *u > 0.0) else {
        // As gpu.pcie-replay does: the counts are kept, without a share to judge.
        return Finding::pass(ID, "uptime unknown, so the held-back time has no share").evidence("violations_ns", v);
    };
    let share = |ns: u64| ns as f64 / 1e9 / uptime;
    let over: Vec<String> = facts::FAULT_VIOLATIONS
        .iter()
        .filter_map(|r| v.get(*r).map(|ns| (*r, *ns)))
        .filter(|(_, ns)| share(*ns) > facts::MAX_VIOLATION_SHARE)
        .map(|(r, ns)| format!("{r} {:.0} s ({:.1} % of the time since boot)", ns as f64 / 1e9, share(ns) * 100.0))
        .collect();
    let f = if over.is_empty() {
        let held: f64 = facts::FAULT_VIOLATIONS.iter().filter_map(|r| v.get(*r)).map(|ns| *ns as f64 / 1e9).sum();
        Finding::pass(ID, format!("{held:.0} s held back by thermal, board-limit or reliability slowdowns since boot"))
    } else {
        Finding::warn(ID, format!("clocks held back: {}", over.join(", ")))
            .detail(format!("Over {} % of the time since boot: the host's cooling or the board slows this GPU, in bursts the 30-second snapshots of gpu.throttle can miss.", facts::MAX_VIOLATION_SHARE * 100.0))
            .remedy("Report the GPU and the reason to the platform (host cooling or power delivery); compare gpu.temperature and the phq_gpu_clock_events_seconds_total series over time.")
    };
    f.evidence("violations_ns", v).evidence("uptime_s", uptime)
}

pub(super) fn temperature(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.temperature";
    let t = match &g.temperature_c {
        Nv::Value(t) => *t,
        other => return missing(ID, "temperature", other),
    };
    let slowdown = g.slowdown_temperature_c.value().copied();
    let f = match slowdown {
        Some(sd) if t >= sd => Finding::fail(ID, format!("{t} °C, at or above the slowdown threshold {sd} °C"))
            .remedy("The host's cooling is not keeping up: report the GPU to the platform; the GPU is throttling."),
        Some(sd) if t + facts::TEMPERATURE_MARGIN_C >= sd => {
            Finding::warn(ID, format!("{t} °C, within {} °C of slowdown at {sd} °C", facts::TEMPERATURE_MARGIN_C))
                .remedy("Watch it under load; report to the platform if it reaches the slowdown threshold.")
        }
        Some(sd) => Finding::pass(ID, format!("{t} °C (slowdown at {sd} °C)")),
        None => Finding::pass(ID, format!("{t} °C (NVML gives no slowdown threshold to compare)")),
    };
    f.evidence("temperature_c", t).evidence("slowdown_c", slowdown).evidence("shutdown_c", &g.shutdown_temperature_c)
}

pub(super) fn power_limit(_s: &Snapshot, g: &NvmlGpu) -> Finding {
    const ID: &str = "gpu.power-limit";
    let (limit, default) = match (&g.power_limit_mw, &g.default_power_limit_mw) {
        (Nv::Value(l), Nv::Value(d)) => (*l, *d),
        (Nv::Value(_), other) | (other, _) => return missing(ID, "power limits", other),
    };
    let f = if limit < default {
        Finding::warn(ID, format!("power capped at {} W of the default {} W", limit / 1000, default / 1000))
            .detail("A lower power limit caps clocks under load: compute throughput drops with it.")
            .remedy(format!("Restore it with `nvidia-smi -i <gpu> -pl {}` if the VM may; otherwise ask the platform why the GPU is capped.", default / 1000))
    } else {
        Finding::pass(ID, format!("{} W enforced (default {} W)", limit / 1000, default / 1000))
    };
    f.evidence("enforced_mw", limit).evidence("default_mw", default).evidence("usage_mw", &g.power_usage_mw)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use crate::checks::Severity;
    use crate::snapshot::*;

    #[test]
    fn degraded_pcie_and_hw_thermal() {
        let mut s = healthy();
        let g = gpu_mut(&mut s, 5);
        g.pcie.width_current = Nv::Value(8);
        g.pcie.gen_current = Nv::Value(3);
        g.throttle_reasons = Nv::Value(vec!["hw_thermal_slowdown".into(), "sw_power_cap".into()]);
        g.temperature_c = Nv::Value(89);
        let mut got = bad(&findings(&s));
        got.sort();
        let addr = "0000:0e:00.0".to_string();
        assert_eq!(
            got,
            vec![
                ("gpu.pcie-link".into(), addr.clone(), Severity::Fail),
                ("gpu.temperature".into(), addr.clone(), Severity::Fail),
                ("gpu.throttle".into(), addr, Severity::Fail)
            ]
        );
    }

    #[test]
    fn temperature_bands() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).temperature_c = Nv::Value(83);
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Warn);
        gpu_mut(&mut s, 0).temperature_c = Nv::Value(87);
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Fail);
        gpu_mut(&mut s, 0).slowdown_temperature_c = Nv::NotSupported;
        assert_eq!(one(&s, "gpu.temperature").severity, Severity::Pass);
    }

    #[test]
    fn sw_thermal_warns_power_cap_passes() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).throttle_reasons = Nv::Value(vec!["sw_power_cap".into()]);
        assert_eq!(one(&s, "gpu.throttle").severity, Severity::Pass);
        gpu_mut(&mut s, 0).throttle_reasons = Nv::Value(vec!["sw_thermal_slowdown".into()]);
        assert_eq!(one(&s, "gpu.throttle").severity, Severity::Warn);
    }

    #[test]
    fn capped_power_limit_warns() {
        let mut s = healthy();
        gpu_mut(&mut s, 0).power_limit_mw = Nv::Value(500_000);
        let f = one(&s, "gpu.power-limit");
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.summary, "power capped at 500 W of the default 700 W");
    }
}
