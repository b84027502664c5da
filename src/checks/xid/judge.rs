//! gpu.xid: per GPU, the Xids of the kernel log and of NVML's event set, each judged the way
//! NVIDIA's catalog says to act on it, and read together with what NVML says of the same GPU.
//!
//! Rules, each kept below:
//! 1. Severity follows the catalog's immediate resolution: a GPU reset, a VM or host restart, a
//!    check of the board or one of NVIDIA's workflows fails the GPU; RESTART_APP warns, naming
//!    the process from the Xid line; IGNORE is reported and passes; a code the catalog sends to
//!    support, gives no action for yet, or does not list at all warns (naming the catalog's
//!    date). — `verdict`
//! 2. NVIDIA's workflows are followed where the snapshot has what they ask for: 45 alone vs
//!    with other Xids, 48 alone vs with 63/64 (and NVML's pending remap), 154 with NVML's
//!    current recovery action, CHECK_UVM with the nvidia_uvm module. — `verdict`
//! 3. What NVML knows of the GPU is said beside the Xids it bears on: ECC counters and row
//!    remapping for 48, 63, 64, 94, 95; the links' state and error counters for 74 and the
//!    NVLink codes; whether NVML still reaches the GPU for 79. — `nvml_notes`
//! 4. NVML's recovery action counts as a judgement of its own, Xid or not: a GPU NVML says must
//!    be reset fails even when the kernel log has rolled over. — `recovery_verdict`
//! 5. The worst verdict governs the finding, and the finding says which one and why. — `judge`

use super::{catalog::XID_READ, words, xid, Immediate, XidEntry};
use crate::checks::{Finding, Severity};
use crate::snapshot::{Fact, Nv, NvmlGpu, Snapshot, XidEvent};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

const ID: &str = "gpu.xid";

/// One Xid code on one GPU, summed over both sources: what `gpu.xid` shows and the report carries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct XidSummary {
    pub code: String,
    /// Reports of this code. The kernel log holds every report since boot and NVML's event set
    /// only those while the agent listened, so the same Xid is usually in both: the count is
    /// the larger of the two, never their sum.
    pub count: usize,
    /// The catalog's description of the code, or why there is none.
    pub meaning: String,
    /// The catalog's immediate resolution as NVIDIA spells it (`RESET_GPU`, …); empty when the
    /// catalog gives none, `unknown` for a code it does not list.
    #[serde(default)]
    pub resolution: String,
    /// Seconds since boot of the first and last report, when the log carries timestamps.
    pub first_seen_s: Option<f64>,
    pub last_seen_s: Option<f64>,
    pub last_message: String,
    /// `kmsg`, `nvml`, or both.
    pub sources: Vec<String>,
}

fn entry_of(code: &str) -> Option<&'static XidEntry> {
    code.parse::<u32>().ok().and_then(xid)
}

/// The catalog's description of `code`, or why there is none.
pub fn meaning(code: &str) -> String {
    match entry_of(code) {
        Some(e) => e.description.to_string(),
        None => format!("not in NVIDIA's Xid catalog of {XID_READ}"),
    }
}

/// The catalog's immediate resolution of `code` as NVIDIA spells it, `unknown` when the code is
/// not in the catalog: the `resolution` label of the Xid counters.
pub fn resolution(code: &str) -> &'static str {
    entry_of(code).map_or("unknown", |e| e.immediate.bucket())
}

/// Groups Xid reports per code from the kernel log and NVML's event set, worst first by the
/// catalog's immediate resolution.
pub fn summarize(kmsg: &[&XidEvent], nvml: &[u64]) -> Vec<XidSummary> {
    let mut by_code: BTreeMap<String, XidSummary> = BTreeMap::new();
    let blank = |code: &str| XidSummary {
        code: code.to_string(),
        count: 0,
        meaning: meaning(code),
        resolution: resolution(code).to_string(),
        first_seen_s: None,
        last_seen_s: None,
        last_message: String::new(),
        sources: Vec::new(),
    };
    for e in kmsg {
        let entry = by_code.entry(e.raw_code.clone()).or_insert_with(|| blank(&e.raw_code));
        entry.count += 1;
        let t = e.usec.map(|u| u as f64 / 1e6);
        entry.first_seen_s = entry.first_seen_s.or(t);
        entry.last_seen_s = t.or(entry.last_seen_s);
        entry.last_message = e.message.clone();
        if entry.sources.is_empty() {
            entry.sources.push("kmsg".into());
        }
    }
    let mut nvml_counts: BTreeMap<u64, usize> = BTreeMap::new();
    for code in nvml {
        *nvml_counts.entry(*code).or_default() += 1;
    }
    for (code, n) in nvml_counts {
        let key = code.to_string();
        let entry = by_code.entry(key.clone()).or_insert_with(|| blank(&key));
        entry.count = entry.count.max(n);
        entry.sources.push("nvml".into());
    }
    let mut v: Vec<XidSummary> = by_code.into_values().collect();
    v.sort_by_key(|x| (std::cmp::Reverse(rank(&x.code)), x.code.parse::<u64>().unwrap_or(u64::MAX)));
    v
}

/// The order the summary lists codes in: those that fail a GPU first, then those that warn,
/// then those reported for the record.
fn rank(code: &str) -> u8 {
    match entry_of(code).map(|e| e.immediate) {
        Some(Immediate::RestartApp) => 1,
        Some(Immediate::Ignore) => 0,
        Some(Immediate::ContactSupport | Immediate::None) | None => 2,
        Some(_) => 3,
    }
}

/// Xid reports for one GPU address from both sources.
pub fn events_for<'a>(s: &'a Snapshot, address: &str) -> (Vec<&'a XidEvent>, Vec<u64>) {
    let prefix = address.rsplit_once('.').map(|(a, _)| a).unwrap_or(address);
    let kmsg = s
        .kernel_log
        .value()
        .map(|l| l.xids.iter().filter(|e| e.pci == prefix || e.pci == address).collect())
        .unwrap_or_default();
    let nvml =
        s.nvml().map(|n| n.xid_events.iter().filter(|e| e.gpu == address).map(|e| e.xid).collect()).unwrap_or_default();
    (kmsg, nvml)
}

/// gpu.xid for every GPU on the bus, and for each address with Xids but no GPU there now.
pub fn run(s: &Snapshot, out: &mut Vec<Finding>) {
    let nvml_listening = s.nvml().is_some_and(|n| n.events_error.is_none());
    let sources = match (&s.kernel_log, nvml_listening) {
        (Fact::Value(l), true) => format!("{} and NVML events", l.source),
        (Fact::Value(l), false) => l.source.clone(),
        (Fact::Error(_), _) => "NVML events".into(),
    };
    let gpus = s.gpus();
    let mut addresses: Vec<String> = gpus.iter().map(|g| g.address.clone()).collect();
    // Xids for an address with no GPU on the bus now (a GPU that fell off the bus): still reported.
    let known = |a: &str| gpus.iter().any(|g| g.address == a || g.address_without_function() == a);
    let mut orphans: Vec<String> = Vec::new();
    for e in s.kernel_log.value().map(|l| l.xids.as_slice()).unwrap_or_default() {
        if !known(&e.pci) && !orphans.contains(&e.pci) {
            orphans.push(e.pci.clone());
        }
    }
    for e in s.nvml().map(|n| n.xid_events.as_slice()).unwrap_or_default() {
        if !known(&e.gpu) && !orphans.contains(&e.gpu) {
            orphans.push(e.gpu.clone());
        }
    }
    addresses.extend(orphans.iter().cloned());
    for address in &addresses {
        let (kmsg, nvml) = events_for(s, address);
        let f = match (&s.kernel_log, kmsg.is_empty() && nvml.is_empty()) {
            (Fact::Error(e), true) if recovery_verdict(s.nvml_gpu(address), address).is_none() => {
                Finding::unknown(ID, format!("cannot read the kernel log: {e}"))
                    .remedy("Run doctor as root (or with CAP_SYSLOG) so it can read /dev/kmsg.")
            }
            _ => judge(s, address, &kmsg, &nvml, &sources),
        };
        let f = f.gpu(address);
        out.push(if orphans.contains(address) {
            Finding { detail: format!("No GPU is at this address on the PCI bus now. {}", f.detail), ..f }
        } else {
            f
        });
    }
    if addresses.is_empty() {
        out.push(match &s.kernel_log {
            Fact::Value(_) => Finding::pass(ID, "no NVIDIA GPU and no Xid in the kernel log"),
            Fact::Error(_) => Finding::pass(ID, "no NVIDIA GPU: nothing to check"),
        });
    }
}

/// What one Xid code (or NVML's recovery action) calls for on this GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    pub severity: Severity,
    /// What to do, for a tenant in the VM.
    pub remedy: String,
    /// Why: the catalog's resolution and what the snapshot adds to it.
    pub why: String,
}

impl Verdict {
    fn new(severity: Severity, remedy: impl Into<String>, why: impl Into<String>) -> Verdict {
        Verdict { severity, remedy: remedy.into(), why: why.into() }
    }
}

/// What the judgement of one code may look at besides the code itself.
struct Context<'a> {
    s: &'a Snapshot,
    address: &'a str,
    nvml: Option<&'a NvmlGpu>,
    /// Every code reported on this GPU.
    codes: Vec<u32>,
    /// This code's kernel log reports.
    events: Vec<&'a XidEvent>,
}

fn judge(s: &Snapshot, address: &str, kmsg: &[&XidEvent], nvml: &[u64], sources: &str) -> Finding {
    let summary = summarize(kmsg, nvml);
    let nv = s.nvml_gpu(address);
    let recovery = recovery_verdict(nv, address);
    if summary.is_empty() {
        return match recovery {
            Some(r) if r.severity > Severity::Pass => {
                Finding { severity: r.severity, ..Finding::pass(ID, format!("no Xid since boot, but {}", r.why)) }
                    .detail(
                        "NVML's recovery action stands for every Xid, including those the kernel log no longer holds.",
                    )
                    .remedy(r.remedy)
                    .evidence("recovery_action", nv.map(|g| &g.recovery_action))
            }
            _ => Finding::pass(ID, format!("no Xid since boot ({sources})")),
        };
    }
    let codes: Vec<u32> = summary.iter().filter_map(|x| x.code.parse().ok()).collect();
    let mut verdicts: Vec<(String, Verdict)> = Vec::new();
    for x in &summary {
        let ctx = Context {
            s,
            address,
            nvml: nv,
            codes: codes.clone(),
            events: kmsg.iter().copied().filter(|e| e.raw_code == x.code).collect(),
        };
        let mut v = verdict(&ctx, x);
        let notes = nvml_notes(&ctx, &x.code);
        if !notes.is_empty() {
            v.why = format!("{} {}", v.why, notes.join(" "));
        }
        verdicts.push((format!("Xid {}", x.code), v));
    }
    if let Some(r) = recovery {
        verdicts.push(("NVML's recovery action".into(), r));
    }
    // Rule 5: the worst governs; among equals, the first (the summary's order, worst first).
    let mut governs = 0;
    for (i, (_, v)) in verdicts.iter().enumerate() {
        if v.severity > verdicts[governs].1.severity {
            governs = i;
        }
    }
    let line =
        summary.iter().map(|x| format!("Xid {} ({}) ×{}", x.code, x.meaning, x.count)).collect::<Vec<_>>().join(", ");
    let (who, g) = &verdicts[governs];
    let mut detail: Vec<String> = verdicts.iter().map(|(name, v)| format!("{name}: {}", v.why)).collect();
    detail.push(format!("Governs: {who} ({}).", sev_word(g.severity)));
    if let Some(last) = summary.iter().find(|x| !x.last_message.is_empty()) {
        detail.push(format!("Last report of Xid {}: {}", last.code, last.last_message));
    }
    // Whose word the governing verdict rests on. NVML's event set is the driver speaking to the
    // agent; the kernel log can be read by anyone who can read it and, for lines the agent did
    // not see arrive, cannot be tied to a listener. A verdict that only the kernel log backs
    // says so, for the platform to weigh (issue 37).
    let governing = summary.iter().find(|x| who.strip_prefix("Xid ") == Some(x.code.as_str()));
    let authority = match governing {
        Some(x) if !x.sources.iter().any(|s| s == "nvml") => "kernel_log",
        _ => "nvml",
    };
    if authority == "kernel_log" && g.severity > Severity::Pass {
        detail.push(format!(
            "Only the kernel log reports {who}: NVML's event set did not (it hears the Xids that come while the agent listens{}).",
            if s.nvml().is_some_and(|n| n.events_error.is_none()) { "" } else { ", and it is not listening now" }
        ));
    }
    let f = Finding { severity: g.severity, ..Finding::pass(ID, line) }.detail(detail.join("\n"));
    let f = if g.severity > Severity::Pass { f.remedy(g.remedy.clone()) } else { f };
    f.evidence("xids", &summary)
        .evidence("governs", who)
        .evidence("authority", authority)
        .evidence("recovery_action", nv.map(|g| &g.recovery_action))
}

fn sev_word(s: Severity) -> &'static str {
    match s {
        Severity::Fail => "fails the GPU",
        Severity::Warn => "warns",
        Severity::Unknown => "cannot tell",
        Severity::Pass => "reported, no action",
    }
}

/// `pid=48211, name=python3, …` → "python3 (pid 48211)"; the driver prints `pid='<unknown>'`
/// and `name=<unknown>` when no process is tied to the Xid (the captures in
/// tests/fixtures/captures, and Xid 79's line).
pub fn process_of(message: &str) -> Option<String> {
    let mut pid = None;
    let mut name = None;
    for part in message.split(',').map(str::trim) {
        if let Some(p) = part.strip_prefix("pid=") {
            pid = p.parse::<u32>().ok();
        } else if let Some(n) = part.strip_prefix("name=") {
            let n = n.trim_matches('\'');
            if !n.is_empty() && n != "<unknown>" {
                name = Some(n.to_string());
            }
        }
    }
    match (name, pid) {
        (Some(n), Some(p)) => Some(format!("{n} (pid {p})")),
        (Some(n), None) => Some(n),
        (None, Some(p)) => Some(format!("the process with pid {p}")),
        (None, None) => None,
    }
}

/// The processes the reports of one code name, at most three.
fn processes(events: &[&XidEvent]) -> Option<String> {
    let mut named: Vec<String> = Vec::new();
    for p in events.iter().filter_map(|e| process_of(&e.message)) {
        if !named.contains(&p) {
            named.push(p);
        }
    }
    let more = named.len().saturating_sub(3);
    named.truncate(3);
    (!named.is_empty()).then(|| {
        let list = named.join(", ");
        if more > 0 {
            format!("{list} and {more} more")
        } else {
            list
        }
    })
}

/// Rules 1 and 2: what one code calls for.
fn verdict(ctx: &Context, x: &XidSummary) -> Verdict {
    use Severity::{Fail, Pass, Warn};
    let Some(e) = entry_of(&x.code) else {
        return Verdict::new(
            Warn,
            words::not_in_catalog(&x.code),
            format!("not in NVIDIA's Xid catalog as read on {XID_READ}."),
        );
    };
    let named = |what: &str| {
        let mut w = format!("{} ({}): NVIDIA's immediate action is {what}", e.description, e.mnemonic);
        if e.unused() {
            w.push_str("; the catalog marks this code unused (deprecated, or seen only on V100 and older)");
        } else if !e.applies.h100 {
            w.push_str("; the catalog lists it for other GPUs than H100");
        }
        w.push('.');
        if !e.investigatory.is_empty() || !e.unused() {
            w.push_str(" To look into it if it comes back: ");
            w.push_str(&words::investigatory(e.investigatory));
        }
        w
    };
    let gpu = ctx.address;
    let others: Vec<u32> = ctx.codes.iter().copied().filter(|c| *c != e.code && *c != 154).collect();
    match e.immediate {
        Immediate::ResetGpu => Verdict::new(Fail, words::reset(gpu), named("RESET_GPU, a GPU reset")),
        Immediate::RestartVm => Verdict::new(Fail, words::RESTART_VM, named("RESTART_VM, a restart of the VM")),
        Immediate::RestartBm => {
            Verdict::new(Fail, words::RESTART_BM, named("RESTART_BM, a restart of the machine (the VM, then the host if that is not enough)"))
        }
        Immediate::CheckMechanicals => {
            Verdict::new(Fail, words::CHECK_MECHANICALS, named("CHECK_MECHANICALS, a check of the board's seating and connections"))
        }
        Immediate::UpdateSwfw => Verdict::new(Fail, words::UPDATE_SWFW, named("UPDATE_SWFW, a driver and firmware update")),
        Immediate::WorkflowNvlinkErr => Verdict::new(
            Fail,
            format!("{} Afterwards `nvidia-smi nvlink -s` should show every link up and `nvidia-smi nvlink -e` no growing error counts; the fault may be at the far end of a link (another GPU, or an NVSwitch: see fabric.sxid).", words::reset(gpu)),
            named("WORKFLOW_NVLINK_ERR, its NVLink workflow: a GPU reset to retrain the links, then the error registers decoded"),
        ),
        Immediate::WorkflowNvlink5Err => Verdict::new(
            Fail,
            words::reset(gpu),
            named("WORKFLOW_NVLINK5_ERR, its NVLink5 workflow: the Xid's IntrInfo and error status decide, most often a GPU reset"),
        ),
        Immediate::WorkflowXid48 => {
            let remap = ctx.nvml.and_then(|g| g.remapped_rows.value()).is_some_and(|r| r.pending || r.failure);
            if ctx.codes.contains(&63) || ctx.codes.contains(&64) || remap {
                Verdict::new(
                    Fail,
                    format!("Drain the GPU (let its jobs finish, start no new ones), then reset it so the row remap takes effect. {}", words::reset(gpu)),
                    named("WORKFLOW_XID_48, its double-bit ECC workflow: with Xid 63/64 or a pending remap, drain and reset"),
                )
            } else {
                Verdict::new(Fail, words::reset(gpu), named("WORKFLOW_XID_48, its double-bit ECC workflow: alone, a GPU reset"))
            }
        }
        Immediate::WorkflowXid45 => {
            if !others.is_empty() {
                let list = others.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ");
                Verdict::new(
                    Pass,
                    "",
                    format!("{} With Xid {list} on this GPU, NVIDIA's workflow says to follow those: the application was torn down because of them.", named("WORKFLOW_XID_45")),
                )
            } else if ctx.s.nvswitches().is_empty() {
                Verdict::new(
                    Warn,
                    words::restart_app(&who(ctx)),
                    format!("{} Alone, NVIDIA's workflow restarts the fabric manager, which a VM without NVSwitches does not have: the driver tore the application's work down (stopped, killed, or after an error the log no longer holds).", named("WORKFLOW_XID_45")),
                )
            } else {
                Verdict::new(Fail, words::FABRIC_MANAGER_RESTART, format!("{} Alone, NVIDIA's workflow restarts the fabric manager.", named("WORKFLOW_XID_45")))
            }
        }
        Immediate::CheckUvm => {
            let uvm = ctx.s.driver.modules.value().is_some_and(|m| m.iter().any(|m| m == "nvidia_uvm"));
            if uvm {
                Verdict::new(Fail, words::reset(gpu), format!("{} nvidia_uvm is loaded (CUDA uses it), so NVIDIA's answer is a GPU reset.", named("CHECK_UVM")))
            } else {
                Verdict::new(Pass, "", format!("{} nvidia_uvm is not loaded, so NVIDIA's answer is to ignore it.", named("CHECK_UVM")))
            }
        }
        Immediate::Xid154 => xid154(ctx, x, named("XID_154: follow the recovery action it reports")),
        Immediate::RestartApp => Verdict::new(
            Warn,
            words::restart_app(&who(ctx)),
            format!("{} It stopped {}.", named("RESTART_APP, a restart of the application"), who(ctx)),
        ),
        Immediate::Ignore => Verdict::new(Pass, "", named("IGNORE: reported for the record, no action")),
        Immediate::ContactSupport => Verdict::new(Warn, words::CONTACT_SUPPORT, named("CONTACT_SUPPORT")),
        Immediate::None => {
            Verdict::new(Warn, words::no_action_yet(&x.code), format!("{} ({}): the catalog (read {XID_READ}) gives no action for it yet.", e.description, e.mnemonic))
        }
    }
}

/// The process the Xid line names, or what to call it when none is named.
fn who(ctx: &Context) -> String {
    processes(&ctx.events).unwrap_or_else(|| "the application that was running (the Xid line names no process)".into())
}

/// NVML's recovery actions (nvml.h `nvmlDeviceGpuRecoveryAction_t`) with what each asks of a
/// tenant and how bad it is. Their meaning: NVIDIA GPU Memory Error Management, "Error Recovery
/// and Response Flags" (docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt).
fn recovery(action: u32, gpu: &str) -> (Severity, &'static str, String) {
    match action {
        0 => (Severity::Pass, "none", String::new()),
        1 => (Severity::Fail, "GPU reset required", words::reset(gpu)),
        2 => (Severity::Fail, "node reboot required", "Restart the VM. If NVML still asks for a reboot after it, the host must be restarted: report it to the platform with `phq-agent doctor --bundle`.".into()),
        3 => (Severity::Warn, "drain P2P", "Stop every process that uses peer-to-peer (NVLink) traffic on this GPU, and UVM persistence mode if it is on; then run doctor again: NVML then names the next action.".into()),
        4 => (Severity::Fail, "drain and reset", format!("Let the GPU's jobs finish and start no new ones, then reset it. {}", words::reset(gpu))),
        // 5 is named RECOVER_IMEX_DOMAIN in go-nvml's nvml.h (2026-07) and GPU_RESET_BUS in
        // nvidia-ml-py: not settled, and neither is a tenant's to act on.
        _ => (Severity::Warn, "an action this agent does not name", "NVML asks for a recovery action nvml.h, as this agent read it, does not define for a tenant: report it to the platform with `phq-agent doctor --bundle`.".into()),
    }
}

/// NVML's current recovery action for the GPU, when NVML reads it.
fn recovery_action(g: Option<&NvmlGpu>) -> Option<u32> {
    g.and_then(|g| g.recovery_action.value().copied())
}

/// Rule 4.
fn recovery_verdict(g: Option<&NvmlGpu>, gpu: &str) -> Option<Verdict> {
    let action = recovery_action(g)?;
    let (severity, name, remedy) = recovery(action, gpu);
    (severity > Severity::Pass)
        .then(|| Verdict::new(severity, remedy, format!("NVML's recovery action for the GPU is {action} ({name}).")))
}

/// `GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)` → 1 (the form in
/// NVIDIA's catalog, Xid 154's trigger conditions).
pub fn action_in_154(message: &str) -> Option<u32> {
    let after = &message[message.find(" to 0x")? + " to 0x".len()..];
    let hex: String = after.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
    u32::from_str_radix(&hex, 16).ok()
}

/// Rule 2 for Xid 154: NVML's recovery action now governs when NVML reads it (the line is
/// history; a reset since then cleared it); otherwise the action the last line names.
fn xid154(ctx: &Context, x: &XidSummary, named: String) -> Verdict {
    let in_line = ctx.events.iter().rev().find_map(|e| action_in_154(&e.message));
    let (action, from) = match (recovery_action(ctx.nvml), in_line) {
        (Some(now), _) => (now, "NVML's current recovery action, which governs over the line: a reset since then clears it"),
        (None, Some(line)) => (line, "the action the last Xid 154 line names (NVML does not read the recovery action here)"),
        (None, None) => {
            return Verdict::new(
                Severity::Warn,
                format!("Xid 154 only accompanies another Xid's recovery: follow the other Xids on this GPU, and reset it when its jobs allow. {}", words::reset(ctx.address)),
                format!("{named} Neither the line ({}) nor NVML says which action.", if x.last_message.is_empty() { "reported through NVML's event set" } else { x.last_message.as_str() }),
            )
        }
    };
    let (severity, name, remedy) = recovery(action, ctx.address);
    Verdict::new(severity, remedy, format!("{named} The action is {action} ({name}), from {from}."))
}

/// Rule 3: what NVML knows of this GPU that bears on `code`.
fn nvml_notes(ctx: &Context, code: &str) -> Vec<String> {
    let mut notes = Vec::new();
    let Ok(code) = code.parse::<u32>() else { return notes };
    let g = ctx.nvml;
    match code {
        48 | 63 | 64 | 94 | 95 | 140 => {
            if let Some(v) = g.and_then(|g| g.ecc_volatile.value()) {
                notes.push(format!("NVML counts {} uncorrectable and {} corrected ECC errors since the last reset.", v.uncorrected, v.corrected));
            }
            match g.map(|g| &g.remapped_rows) {
                Some(Nv::Value(r)) if r.failure => notes.push("NVML says row remapping failed: no spare row is left, so the GPU must be replaced (gpu.row-remap).".into()),
                Some(Nv::Value(r)) if r.pending => notes.push("NVML says a row remap is pending: it takes effect at the next GPU reset (gpu.row-remap).".into()),
                Some(Nv::Value(r)) => notes.push(format!("NVML shows {} rows remapped for uncorrectable errors, none pending.", r.uncorrectable)),
                _ => {}
            }
        }
        74 | 136 | 137 | 144..=150 | 155 => {
            if let Some(links) = g.and_then(|g| g.nvlinks.value()) {
                let down: Vec<String> = links.iter().filter(|l| l.active == Nv::Value(false)).map(|l| l.link.to_string()).collect();
                let erring: Vec<String> = links
                    .iter()
                    .filter(|l| [&l.replay_errors, &l.recovery_errors, &l.crc_flit_errors, &l.crc_data_errors].iter().any(|c| c.value().is_some_and(|c| *c > 0)))
                    .map(|l| l.link.to_string())
                    .collect();
                notes.push(match (down.is_empty(), erring.is_empty()) {
                    (true, true) => format!("NVML shows all {} NVLinks up with no error counts now.", links.len()),
                    (false, _) => format!("NVML shows NVLinks {} down (nvlink.links-active){}.", down.join(", "), if erring.is_empty() { String::new() } else { format!(" and error counts on links {}", erring.join(", ")) }),
                    (true, false) => format!("NVML shows error counts on NVLinks {} (nvlink.errors).", erring.join(", ")),
                });
            }
            if code == 74 && fatal_sxid(ctx.s) {
                notes.push("An NVSwitch reported a fatal SXid, which reaches the GPUs behind it as Xid 74 (Fabric Manager User Guide): see fabric.sxid.".into());
            }
        }
        79 => notes.push(match g {
            None => "NVML does not list the GPU: it is still lost.".into(),
            Some(g) if matches!((&g.temperature_c, &g.memory), (Nv::Error(_), Nv::Error(_))) => {
                "NVML lists the GPU but cannot read it (GPU is lost).".into()
            }
            Some(_) => "NVML answers for the GPU now: it came back since the Xid, but NVIDIA still asks for the machine to be restarted.".into(),
        }),
        _ => {}
    }
    notes
}

/// Whether the kernel log holds a fatal SXid.
fn fatal_sxid(s: &Snapshot) -> bool {
    s.kernel_log.value().is_some_and(|l| l.sxids.iter().any(|x| x.fatal))
}

#[cfg(test)]
mod tests {
    use super::super::catalog::XIDS;
    use super::*;
    use crate::checks::testutil::*;
    use crate::snapshot::*;

    /// `healthy()` with `kmsg` (kmsg records, one per line) as its kernel log, read by the real
    /// parser.
    fn with_log(kmsg: &str) -> Snapshot {
        let mut s = healthy();
        s.kernel_log = Fact::Value(crate::collect::kmsg::parse(kmsg, "/dev/kmsg"));
        s
    }

    /// A kmsg record of an Xid on the GPU at 0000:0c:00, as the driver prints it.
    fn xid_line(seq: u64, code: &str, rest: &str) -> String {
        format!("4,{seq},{},-;NVRM: Xid (PCI:0000:0c:00): {code}, {rest}\n", seq * 1_000_000)
    }

    fn xids(s: &Snapshot) -> Vec<Finding> {
        let mut out = Vec::new();
        run(s, &mut out);
        out
    }

    fn on_0c(s: &Snapshot) -> Finding {
        xids(s).into_iter().find(|f| f.gpu.as_deref() == Some("0000:0c:00.0")).unwrap()
    }

    /// The issue's rule, written out here apart from the code that applies it: what each of the
    /// catalog's immediate resolutions calls for, for one Xid alone on an HGX guest (NVSwitches,
    /// nvidia_uvm loaded, NVML not reading the recovery action).
    fn expected(i: Immediate) -> Severity {
        match i {
            Immediate::ResetGpu
            | Immediate::RestartVm
            | Immediate::RestartBm
            | Immediate::CheckMechanicals
            | Immediate::UpdateSwfw
            | Immediate::WorkflowXid45
            | Immediate::WorkflowXid48
            | Immediate::WorkflowNvlinkErr
            | Immediate::WorkflowNvlink5Err
            | Immediate::CheckUvm => Severity::Fail,
            // The line names "GPU Reset Required" (below), and NVML does not read the action.
            Immediate::Xid154 => Severity::Fail,
            Immediate::RestartApp | Immediate::ContactSupport | Immediate::None => Severity::Warn,
            Immediate::Ignore => Severity::Pass,
        }
    }

    /// Issue 37: a verdict that only the kernel log backs says so; one NVML's event set also
    /// reported rests on NVML.
    #[test]
    fn a_kernel_log_only_xid_says_so() {
        let mut s = with_log(&xid_line(1300, "79", "pid='<unknown>', name=<unknown>, GPU has fallen off the bus."));
        let f = on_0c(&s);
        assert_eq!((f.severity, f.evidence["authority"].as_str()), (Severity::Fail, Some("kernel_log")));
        assert!(f.detail.contains("Only the kernel log reports Xid 79"), "{}", f.detail);
        if let NvmlStatus::Ok(n) = &mut s.nvml {
            n.xid_events.push(NvmlXid { gpu: "0000:0c:00.0".into(), xid: 79 });
        }
        let f = on_0c(&s);
        assert_eq!((f.severity, f.evidence["authority"].as_str()), (Severity::Fail, Some("nvml")));
        assert!(!f.detail.contains("Only the kernel log"), "{}", f.detail);
    }

    /// Every code of NVIDIA's catalog, in a guest's kernel log for one GPU: the severity its
    /// immediate resolution calls for, its own description in the summary, the catalog's
    /// resolution in the evidence, and no other GPU touched.
    #[test]
    fn every_catalog_code_gets_the_severity_its_immediate_resolution_calls_for() {
        assert_eq!(XIDS.len(), 172);
        for e in XIDS {
            let rest = if e.code == 154 {
                "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)".to_string()
            } else {
                "pid=48211, name=python3, Ch 00000008".to_string()
            };
            let mut s = with_log(&xid_line(1300, &e.code.to_string(), &rest));
            gpu_mut(&mut s, 3).recovery_action = Nv::NotSupported;
            let all = xids(&s);
            let f = all.iter().find(|f| f.gpu.as_deref() == Some("0000:0c:00.0")).unwrap();
            assert_eq!(f.severity, expected(e.immediate), "Xid {} ({}): {f:#?}", e.code, e.immediate.bucket());
            assert!(
                f.summary.contains(&format!("Xid {} ({}) ×1", e.code, e.description)),
                "Xid {}: {}",
                e.code,
                f.summary
            );
            assert_eq!(f.evidence["xids"][0]["resolution"], e.immediate.bucket(), "Xid {}", e.code);
            if f.severity != Severity::Pass {
                assert!(f.remedy.as_ref().is_some_and(|r| !r.is_empty()), "Xid {} has no remedy", e.code);
            }
            if e.immediate == Immediate::RestartApp {
                assert!(f.remedy.as_ref().unwrap().contains("python3 (pid 48211)"), "Xid {}: {:?}", e.code, f.remedy);
            }
            assert!(
                all.iter().filter(|f| f.gpu.as_deref() != Some("0000:0c:00.0")).all(|f| f.severity == Severity::Pass),
                "Xid {} touched another GPU",
                e.code
            );
        }
    }

    /// The five codes the agent once called "not in its table": NVIDIA resets the GPU or
    /// restarts the VM, and so does the finding.
    #[test]
    fn codes_the_hand_table_missed_fail_with_the_catalogs_action() {
        for (code, words) in [
            ("46", "nvidia-smi -r -i 0000:0c:00.0"),
            ("110", "nvidia-smi -r"),
            ("151", "Restart the VM"),
            ("156", "nvidia-smi -r"),
            ("158", "nvidia-smi -r"),
        ] {
            let f = on_0c(&with_log(&xid_line(1300, code, "pid=1, name=x, y")));
            assert_eq!(f.severity, Severity::Fail, "{code}");
            assert!(f.remedy.as_ref().unwrap().contains(words), "{code}: {:?}", f.remedy);
            assert!(!f.summary.contains("not in"), "{code}: {}", f.summary);
        }
    }

    #[test]
    fn restart_app_names_the_process_and_says_the_gpu_is_fine() {
        let f = on_0c(&with_log(&xid_line(
            1300,
            "13",
            "pid=48211, name=python3, Graphics Exception: ESR 0x50df30=0x107000e",
        )));
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.summary, "Xid 13 (Graphics Engine Exception) ×1");
        let r = f.remedy.unwrap();
        assert!(r.starts_with("Restart python3 (pid 48211)."), "{r}");
        assert!(r.contains("GPU itself is fine unless this Xid repeats"), "{r}");
        // The investigatory resolution beside it.
        assert!(f.detail.contains("compute-sanitizer"), "{}", f.detail);
    }

    #[test]
    fn a_code_absent_from_the_catalog_warns_naming_the_catalogs_date() {
        for code in ["7777", "99999999999999999999999"] {
            let f = on_0c(&with_log(&xid_line(1300, code, "x")));
            assert_eq!(f.severity, Severity::Warn, "{code}");
            assert!(f.summary.contains(&format!("not in NVIDIA's Xid catalog of {XID_READ}")), "{}", f.summary);
            assert!(f.remedy.unwrap().contains(XID_READ));
            assert_eq!(f.evidence["xids"][0]["resolution"], "unknown");
        }
    }

    #[test]
    fn unused_codes_are_known_as_such() {
        let f = on_0c(&with_log(&xid_line(1300, "56", "x")));
        assert_eq!(f.severity, Severity::Warn);
        assert_eq!(f.summary, "Xid 56 (Unused) ×1");
        assert!(f.detail.contains("marks this code unused"), "{}", f.detail);
    }

    #[test]
    fn ignore_is_reported_not_a_warning() {
        let f = on_0c(&with_log(&xid_line(1300, "63", "x")));
        assert_eq!(f.severity, Severity::Pass);
        assert_eq!(f.summary, "Xid 63 (GPU memory remapping event) ×1");
        assert_eq!(f.remedy, None);
    }

    #[test]
    fn worst_governs_and_the_finding_says_so() {
        let log = xid_line(1300, "13", "pid=7, name=a, x")
            + &xid_line(1301, "13", "pid=8, name=b, x")
            + &xid_line(1302, "119", "pid=9, name=c, Timeout after 6s");
        let f = on_0c(&with_log(&log));
        assert_eq!(f.severity, Severity::Fail);
        assert!(
            f.summary.starts_with("Xid 119 (GSP RPC Timeout) ×1, Xid 13 (Graphics Engine Exception) ×2"),
            "{}",
            f.summary
        );
        assert!(f.detail.contains("Governs: Xid 119 (fails the GPU)."), "{}", f.detail);
        assert_eq!(f.evidence["governs"], "Xid 119");
        assert!(f.detail.contains("It stopped a (pid 7), b (pid 8)."), "{}", f.detail);
    }

    #[test]
    fn xid_45_follows_the_others_and_alone_restarts_the_fabric_manager() {
        let with_48 = xid_line(1300, "48", "pid=7, name=a, DBE") + &xid_line(1301, "45", "pid=7, name=a, Ch 8");
        let f = on_0c(&with_log(&with_48));
        assert_eq!(f.evidence["governs"], "Xid 48");
        assert!(f.detail.contains("With Xid 48 on this GPU, NVIDIA's workflow says to follow those"), "{}", f.detail);
        let alone = on_0c(&with_log(&xid_line(1300, "45", "pid=7, name=a, Ch 8")));
        assert_eq!(alone.severity, Severity::Fail);
        assert!(alone.remedy.unwrap().contains("systemctl restart nvidia-fabricmanager"));
        // Without NVSwitches there is no fabric manager to restart: the application was torn down.
        let mut s = with_log(&xid_line(1300, "45", "pid=7, name=a, Ch 8"));
        if let Fact::Value(d) = &mut s.pci {
            d.retain(|d| !d.is_nvswitch());
        }
        let f = on_0c(&s);
        assert_eq!(f.severity, Severity::Warn);
        assert!(f.remedy.unwrap().starts_with("Restart a (pid 7)."));
    }

    #[test]
    fn xid_48_with_63_or_a_pending_remap_is_drain_and_reset_and_says_what_nvml_counts() {
        let alone = on_0c(&with_log(&xid_line(1300, "48", "pid=7, name=a, DBE")));
        assert_eq!(alone.severity, Severity::Fail);
        assert!(alone.remedy.as_ref().unwrap().starts_with("Stop the processes on the GPU"), "{:?}", alone.remedy);
        assert!(alone.detail.contains("NVML counts 0 uncorrectable and 0 corrected ECC errors"), "{}", alone.detail);
        let with_63 = on_0c(&with_log(&(xid_line(1300, "48", "x") + &xid_line(1301, "63", "x"))));
        assert!(with_63.remedy.unwrap().starts_with("Drain the GPU"));
        let mut s = with_log(&xid_line(1300, "48", "x"));
        gpu_mut(&mut s, 3).remapped_rows =
            Nv::Value(RemappedRows { correctable: 0, uncorrectable: 1, pending: true, failure: false });
        gpu_mut(&mut s, 3).ecc_volatile = Nv::Value(EccCounts { corrected: 2, uncorrected: 1 });
        let f = on_0c(&s);
        assert!(f.remedy.unwrap().starts_with("Drain the GPU"));
        assert!(f.detail.contains("NVML counts 1 uncorrectable and 2 corrected ECC errors"), "{}", f.detail);
        assert!(f.detail.contains("a row remap is pending"), "{}", f.detail);
    }

    #[test]
    fn xid_154_follows_nvmls_current_action_over_the_line() {
        let line = xid_line(1300, "154", "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)");
        // healthy(): NVML reads the action, and it is none now: the reset already happened.
        let f = on_0c(&with_log(&line));
        assert_eq!(f.severity, Severity::Pass, "{f:#?}");
        assert!(f.detail.contains("The action is 0 (none), from NVML's current recovery action"), "{}", f.detail);
        let mut s = with_log(&line);
        gpu_mut(&mut s, 3).recovery_action = Nv::NotSupported;
        let f = on_0c(&s);
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.detail.contains("from the action the last Xid 154 line names"), "{}", f.detail);
        gpu_mut(&mut s, 3).recovery_action = Nv::Value(3);
        let f = on_0c(&s);
        assert_eq!(f.severity, Severity::Warn, "drain P2P");
        assert!(f.remedy.unwrap().contains("peer-to-peer"));
        assert_eq!(action_in_154("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)"), Some(2));
        assert_eq!(action_in_154("no action"), None);
    }

    #[test]
    fn nvmls_recovery_action_fails_a_gpu_whose_xids_the_log_no_longer_holds() {
        let mut s = healthy();
        gpu_mut(&mut s, 3).recovery_action = Nv::Value(1);
        let f = on_0c(&s);
        assert_eq!(f.severity, Severity::Fail);
        assert!(
            f.summary.contains("no Xid since boot, but NVML's recovery action for the GPU is 1 (GPU reset required)"),
            "{}",
            f.summary
        );
        assert!(f.remedy.unwrap().contains("nvidia-smi -r -i 0000:0c:00.0"));
        // And it governs over a milder Xid.
        let mut s = with_log(&xid_line(1300, "13", "pid=1, name=a, x"));
        gpu_mut(&mut s, 3).recovery_action = Nv::Value(2);
        let f = on_0c(&s);
        assert_eq!((f.severity, f.evidence["governs"].as_str()), (Severity::Fail, Some("NVML's recovery action")));
    }

    #[test]
    fn nvlink_xids_say_what_nvml_shows_of_the_links_and_of_a_fatal_sxid() {
        let mut s = with_log(
            &(xid_line(1300, "74", "pid='<unknown>', name=<unknown>, NVLink: fatal error detected on link 4")
                + "4,1301,2000000,-;nvidia-nvswitch0: SXid (PCI:0000:11:00.0): 20034, Fatal, Link 30 LTSSM Fault Up\n"),
        );
        if let Nv::Value(l) = &mut gpu_mut(&mut s, 3).nvlinks {
            l[4].active = Nv::Value(false);
            l[5].replay_errors = Nv::Value(3);
        }
        let f = on_0c(&s);
        assert_eq!(f.severity, Severity::Fail);
        assert!(
            f.detail.contains("NVML shows NVLinks 4 down (nvlink.links-active) and error counts on links 5."),
            "{}",
            f.detail
        );
        assert!(f.detail.contains("see fabric.sxid"), "{}", f.detail);
        assert!(f.remedy.unwrap().contains("nvidia-smi nvlink -s"));
    }

    #[test]
    fn xid_79_says_whether_nvml_still_reaches_the_gpu() {
        let line = xid_line(1300, "79", "pid='<unknown>', name=<unknown>, GPU has fallen off the bus.");
        let f = on_0c(&with_log(&line));
        assert!(f.detail.contains("NVML answers for the GPU now"), "{}", f.detail);
        assert!(f.remedy.as_ref().unwrap().starts_with("Restart the VM."));
        // No process is named for it.
        assert!(!f.detail.contains("(pid"), "{}", f.detail);
        let mut s = with_log(&line);
        gpu_mut(&mut s, 3).temperature_c = Nv::Error("GPU is lost".into());
        gpu_mut(&mut s, 3).memory = Nv::Error("GPU is lost".into());
        assert!(on_0c(&s).detail.contains("cannot read it (GPU is lost)"));
    }

    #[test]
    fn check_uvm_resets_only_when_uvm_is_in_use() {
        let line = xid_line(1300, "159", "x");
        assert_eq!(on_0c(&with_log(&line)).severity, Severity::Fail);
        let mut s = with_log(&line);
        s.driver.modules = Fact::Value(vec!["nvidia".into()]);
        assert_eq!(on_0c(&s).severity, Severity::Pass);
    }

    #[test]
    fn process_forms() {
        assert_eq!(
            process_of("pid=2024380, name=nvidia-smi, Timeout after 6s").as_deref(),
            Some("nvidia-smi (pid 2024380)")
        );
        assert_eq!(process_of("pid='<unknown>', name=<unknown>, GPU has fallen off the bus."), None);
        assert_eq!(process_of("Ch 00000001"), None);
    }

    #[test]
    fn xid_for_a_vanished_gpu_is_still_reported() {
        let s = with_log("4,1300,5000000,-;NVRM: Xid (PCI:0000:42:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.\n");
        let f = xids(&s).into_iter().find(|f| f.gpu.as_deref() == Some("0000:42:00")).unwrap();
        assert_eq!(f.severity, Severity::Fail);
        assert!(f.detail.starts_with("No GPU is at this address"));
        assert!(f.detail.contains("NVML does not list the GPU: it is still lost."), "{}", f.detail);
    }

    #[test]
    fn unreadable_log_is_unknown_with_remedy() {
        let mut s = healthy();
        s.kernel_log = Fact::Error("/dev/kmsg: Permission denied".into());
        let f = &xids(&s)[0];
        assert_eq!(f.severity, Severity::Unknown);
        assert!(f.summary.contains("Permission denied"));
    }
}
