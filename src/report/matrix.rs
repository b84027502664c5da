//! The GPU↔GPU matrices — peer copy bandwidth and latency, every GPU to every GPU — taken from
//! a report's probe results, for the terminal (here) and for the bundle's page (`html`).
//!
//! Laid out as nvbandwidth prints its matrices (NVIDIA/nvbandwidth: the README's example output
//! and `testcases_ce.cpp`, `DeviceToDeviceReadCE::run`; `device_to_device_memcpy_read_ce` prints
//! a title naming the direction, `memcpy CE GPU(row) -> GPU(column) bandwidth (GB/s)`, the
//! destinations across, one right-aligned row per source, and `N/A` on the diagonal, where a GPU
//! would copy to itself — v0.10's output; the first versions printed 0.00 there). The GPU numbers are the
//! CUDA ordinals the probes use, which follow PCI order (`CUDA_DEVICE_ORDER=PCI_BUS_ID`), as
//! nvidia-smi numbers GPUs.
//!
//! A cell below the floor is the one `probe.p2p-bandwidth` fails: an NVLink pair under its source
//! GPU's SKU floor (`facts::probe_floors`). It always carries a `*`, so a pipe, a file or `less`
//! shows it; on a terminal it is also red (the caller prints through anstream, which drops colour
//! for NO_COLOR and non-terminals). Pure: the report in, text out.

use super::Report;
use crate::probe::{Outcome, PeerLink, ProbeReport};
use anstyle::{AnsiColor, Style};
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// What one ordered pair measured.
#[derive(Debug, Clone, PartialEq)]
pub enum Figure {
    Measured(f64),
    /// The GPUs have no peer access: no peer copy is possible.
    NoAccess,
    /// The measurement failed, with CUDA's words.
    Failed(String),
    /// Not asked, or not answered (a backend without the probe, a GPU lost earlier).
    NotMeasured,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Cell {
    pub gbps: Figure,
    pub latency_ns: Figure,
    /// `nvlink`, `pcie` or `none`, as the probe decided it.
    pub scope: String,
    /// The source GPU's NVLink floor, when the pair is an NVLink pair and its SKU has one.
    pub floor_gbps: Option<f64>,
}

impl Cell {
    /// Below the floor: the pair `probe.p2p-bandwidth` fails its source GPU for.
    pub fn slow(&self) -> bool {
        matches!((&self.gbps, self.floor_gbps), (Figure::Measured(v), Some(fl)) if *v < fl)
    }
}

/// The probed GPUs and every ordered pair among them.
#[derive(Debug, Clone, PartialEq)]
pub struct PeerMatrix {
    /// CUDA ordinals (nvidia-smi's numbers) with their PCI addresses, in order.
    pub gpus: Vec<(usize, String)>,
    pub cells: BTreeMap<(usize, usize), Cell>,
    /// `probe.nvlink-scope`'s line, when the run had one.
    pub scope_line: Option<String>,
}

impl PeerMatrix {
    /// The matrix of a report whose probes ran on two GPUs or more; `None` otherwise.
    pub fn of(r: &Report) -> Option<PeerMatrix> {
        let probes: ProbeReport = serde_json::from_value(r.probes.clone()?).ok()?;
        // n × n cells, twice on the page: only for as many GPUs as a report may list
        // (report::untrusted; a bundle with more is refused before it gets here).
        if probes.gpus.len() < 2 || probes.gpus.len() > super::untrusted::MAX_GPUS {
            return None;
        }
        let mut gpus: Vec<(usize, String)> = probes.gpus.iter().map(|g| (g.ordinal, g.pci.clone())).collect();
        gpus.sort();
        let floor_of = |ordinal: usize| -> Option<f64> {
            let pci = &gpus.iter().find(|(o, _)| *o == ordinal)?.1;
            let summary = r.gpus.iter().find(|g| g.pci_address.eq_ignore_ascii_case(pci))?;
            let device = u16::from_str_radix(summary.pci_id.split_once(':')?.1, 16).ok()?;
            crate::facts::probe_floors(device).p2p_gbps
        };
        let cells = probes
            .peers
            .iter()
            .map(|l: &PeerLink| {
                let cell = Cell {
                    gbps: figure(l, l.gbps.as_ref()),
                    latency_ns: figure(l, l.latency_ns.as_ref()),
                    scope: l.scope.clone(),
                    floor_gbps: if l.scope == "nvlink" { floor_of(l.src) } else { None },
                };
                ((l.src, l.dst), cell)
            })
            .collect();
        let scope_line = r.findings.iter().find(|f| f.id == "probe.nvlink-scope").map(|f| f.summary.clone());
        Some(PeerMatrix { gpus, cells, scope_line })
    }

    /// The one floor every NVLink pair is held to, when they share one (one SKU per VM).
    pub fn floor(&self) -> Option<f64> {
        let floors: Vec<f64> = self.cells.values().filter_map(|c| c.floor_gbps).collect();
        let first = *floors.first()?;
        floors.iter().all(|f| *f == first).then_some(first)
    }

    pub fn slow_cells(&self) -> Vec<(usize, usize)> {
        self.cells.iter().filter(|(_, c)| c.slow()).map(|(k, _)| *k).collect()
    }
}

fn figure(l: &PeerLink, o: Option<&Outcome<crate::probe::Stat>>) -> Figure {
    match o {
        Some(Outcome::Ok(s)) => Figure::Measured(s.median),
        Some(Outcome::Error(e)) => Figure::Failed(e.to_string()),
        None if !l.peer_access => Figure::NoAccess,
        None => Figure::NotMeasured,
    }
}

const SLOW: Style = AnsiColor::Red.on_default().bold();
const BOLD: Style = Style::new().bold();
const DIM: Style = Style::new().dimmed();
/// Wide enough for `1234.5*` and nvbandwidth's column spacing.
const CELL_W: usize = 9;

/// Both matrices and the scope line, ready to print after the findings; empty when the report
/// has no peer measurements.
pub fn terminal(r: &Report) -> String {
    PeerMatrix::of(r).map(|m| render(&m)).unwrap_or_default()
}

/// Both matrices of `m` and its scope line, as `terminal` prints them.
pub fn render(m: &PeerMatrix) -> String {
    let mut o = String::new();
    let floor_note = match m.floor() {
        Some(fl) => format!("; * below the NVLink floor of {fl:.0} GB/s"),
        None if m.cells.values().any(|c| c.floor_gbps.is_some()) => "; * below its GPU's NVLink floor".into(),
        None => String::new(),
    };
    let _ = writeln!(o, "\n{BOLD}GPU↔GPU peer copy bandwidth (GB/s), GPU(row) -> GPU(column){BOLD:#}{floor_note}");
    grid(&mut o, m, |c| (text_of(&c.gbps, 1), c.slow()));
    let _ = writeln!(o, "\n{BOLD}GPU↔GPU latency (ns), a kernel on GPU(row) reads GPU(column)'s memory{BOLD:#}");
    grid(&mut o, m, |c| (text_of(&c.latency_ns, 0), false));
    let _ = writeln!(
        o,
        "{DIM}GPU numbers as nvidia-smi's (PCI order). N/A: the GPU itself; none: no peer access; err: the \
         measurement failed; -: not measured.{DIM:#}"
    );
    if let Some(line) = &m.scope_line {
        let _ = writeln!(o, "NVLink scope: {line}");
    }
    o
}

fn text_of(f: &Figure, decimals: usize) -> String {
    match f {
        Figure::Measured(v) => format!("{v:.decimals$}"),
        Figure::NoAccess => "none".into(),
        Figure::Failed(_) => "err".into(),
        Figure::NotMeasured => "-".into(),
    }
}

/// One matrix: destinations across, sources down. The marker takes a column of its own after
/// the number, so columns stay aligned whether or not a cell is marked (and without colour).
fn grid(o: &mut String, m: &PeerMatrix, cell: impl Fn(&Cell) -> (String, bool)) {
    let mut head = " ".repeat(4);
    for (dst, _) in &m.gpus {
        let _ = write!(head, "{dst:>CELL_W$} ");
    }
    let _ = writeln!(o, "{}", head.trim_end());
    for (src, _) in &m.gpus {
        let mut line = format!("{src:>4}");
        for (dst, _) in &m.gpus {
            let (text, slow) = match m.cells.get(&(*src, *dst)) {
                _ if src == dst => ("N/A".to_string(), false),
                Some(c) => cell(c),
                None => ("-".to_string(), false),
            };
            if slow {
                let _ = write!(line, "{SLOW}{text:>CELL_W$}*{SLOW:#}");
            } else {
                let _ = write!(line, "{text:>CELL_W$} ");
            }
        }
        let _ = writeln!(o, "{}", line.trim_end());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(gbps: Figure, scope: &str, floor: Option<f64>) -> Cell {
        Cell { gbps, latency_ns: Figure::NotMeasured, scope: scope.into(), floor_gbps: floor }
    }

    /// Only an NVLink pair under its floor is marked: a PCIe pair has no NVLink floor to be under
    /// (probe.p2p-bandwidth warns about it instead), and a pair without peer access or whose copy
    /// failed says so in words.
    #[test]
    fn only_nvlink_pairs_under_the_floor_are_marked() {
        let gpus: Vec<(usize, String)> = (0..3).map(|n| (n, format!("0000:0{n}:00.0"))).collect();
        let cells = BTreeMap::from([
            ((0, 1), cell(Figure::Measured(120.0), "nvlink", Some(335.0))),
            ((1, 0), cell(Figure::Measured(380.0), "nvlink", Some(335.0))),
            ((0, 2), cell(Figure::Measured(50.0), "pcie", None)),
            ((2, 0), cell(Figure::NoAccess, "none", None)),
            ((1, 2), cell(Figure::Failed("CUDA_ERROR_ILLEGAL_ADDRESS".into()), "nvlink", Some(335.0))),
        ]);
        let m = PeerMatrix { gpus, cells, scope_line: Some("3 GPU(s)".into()) };
        assert_eq!(m.slow_cells(), vec![(0, 1)]);
        assert_eq!(m.floor(), Some(335.0));
        // As a pipe gets it: anstream strips the colour.
        let text = anstream::adapter::strip_str(&render(&m)).to_string();
        let rows: Vec<Vec<&str>> = text
            .lines()
            .skip_while(|l| !l.contains("bandwidth"))
            .skip(2)
            .take(3)
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0], ["0", "N/A", "120.0*", "50.0"]);
        assert_eq!(rows[1], ["1", "380.0", "N/A", "err"]);
        assert_eq!(rows[2], ["2", "none", "-", "N/A"]);
        assert!(text.ends_with("NVLink scope: 3 GPU(s)\n"), "{text}");
    }
}
