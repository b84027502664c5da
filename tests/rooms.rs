//! The rooms of the crate stand in an order, and imports go down it: a room uses the rooms below
//! it, never one above it and never one beside it, and within a room no two files import each
//! other, however indirectly (issue 38: "no circles, no climbs"). docs/architecture.md ("The
//! rooms") says the same for people; this test reads every `crate::`, `super::` and `self::`
//! path in `src/` and holds the code to the table below.
//!
//! A new top-level module fails the test until it is given its place in `ROOMS`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The rooms from the bottom up. A room may use any room on a lower line; rooms on one line
/// use none of each other.
const ROOMS: &[&[&str]] = &[
    // The one door to the file system, the one atomic writer, the numbers every judgement uses,
    // and the CUDA libraries' bindings.
    &["sysroot", "durable", "facts", "cuda", "text"],
    // The data model everything is read into.
    &["snapshot"],
    // Reading the machine.
    &["collect"],
    // Configuration (which names `collect`'s NVML deadlines).
    &["config"],
    // Judging a snapshot.
    &["checks"],
    // What each GPU has shown across boots (findings kept by serial).
    &["history"],
    // Acting on what was judged: measuring the GPUs, installing the driver.
    &["probe", "install"],
    // Rendering a snapshot, its findings and the probe results.
    &["report"],
    // The service.
    &["serve"],
    // The command line, the top.
    &["cli"],
];

/// Files of the crate root that are not rooms: what wires the rooms together.
const ROOTS: &[&str] = &["lib.rs", "main.rs"];

fn level(room: &str) -> Option<usize> {
    ROOMS.iter().position(|line| line.contains(&room))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect::<Vec<_>>();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") && !test_only(&p) {
            out.push(p);
        }
    }
}

/// Whether the file is a module its parent declares only for tests (`#[cfg(test)] mod x;`):
/// a test double or the tests beside a room are not part of the house the build ships.
fn test_only(file: &Path) -> bool {
    let Some(stem) = file.file_stem().and_then(|s| s.to_str()) else { return false };
    let dir = file.parent().unwrap_or(Path::new("."));
    // The parent is `dir.rs` beside the directory, or `mod.rs`/`lib.rs` in the same directory.
    let parents = [dir.with_extension("rs"), dir.join("mod.rs"), dir.join("lib.rs")];
    parents.iter().filter(|p| p.as_path() != file).filter_map(|p| std::fs::read_to_string(p).ok()).any(|text| {
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        lines.windows(2).any(|w| {
            let decl = w[1].trim_start_matches("pub(crate) ").trim_start_matches("pub ");
            w[0] == "#[cfg(test)]" && decl == format!("mod {stem};")
        })
    })
}

/// The module path of a file under `src/`: `checks/mod.rs` → `[checks]`, `checks/xid/sxid.rs`
/// → `[checks, xid, sxid]`.
fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" {
        parts.push(stem.to_string());
    }
    parts
}

/// The code of a source file as built outside tests: without its comments (a path named in a
/// comment is no import) and without an inline test module (where `super` is the file itself).
fn code(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let inline_tests = |i: usize| {
        lines[i].trim() == "#[cfg(test)]"
            && lines.get(i + 1).is_some_and(|l| {
                let l = l.trim_start_matches("pub(crate) ").trim_start_matches("pub ");
                l.starts_with("mod ") && l.trim_end().ends_with('{')
            })
    };
    let end = (0..lines.len()).find(|i| inline_tests(*i)).unwrap_or(lines.len());
    lines[..end].iter().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// Every path the code names from `crate`, `super` or `self`, as written, with `use` groups
/// (`super::{a, b::c}`) expanded into one path each.
fn paths(code: &str) -> Vec<Vec<String>> {
    let bytes: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(bytes[i - 1].is_alphanumeric() || bytes[i - 1] == '_' || bytes[i - 1] == ':');
        let rest: String = bytes[i..bytes.len().min(i + 6)].iter().collect();
        let head = ["crate", "super", "self"].into_iter().find(|h| rest.starts_with(h));
        match head {
            Some(h) if starts_word && bytes.get(i + h.len()) == Some(&':') => {
                let (found, end) = path_at(&bytes, i);
                out.extend(found);
                i = end.max(i + 1);
            }
            _ => i += 1,
        }
    }
    out
}

/// The path (or the paths of a group) starting at `i`, and where it ends.
fn path_at(s: &[char], mut i: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        let start = i;
        while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
            i += 1;
        }
        if i > start {
            prefix.push(s[start..i].iter().collect::<String>());
        }
        if s.get(i) == Some(&':') && s.get(i + 1) == Some(&':') {
            i += 2;
            if s.get(i) == Some(&'{') {
                // A group: each item, a path of its own after the prefix.
                let mut out = Vec::new();
                i += 1;
                loop {
                    while i < s.len() && (s[i].is_whitespace() || s[i] == ',') {
                        i += 1;
                    }
                    if i >= s.len() || s[i] == '}' {
                        return (out, i + 1);
                    }
                    let (inner, end) = path_at(s, i);
                    for p in inner {
                        out.push(prefix.iter().cloned().chain(p).collect());
                    }
                    // Skip what follows the item (`as name`) up to the next item.
                    i = end;
                    while i < s.len() && s[i] != ',' && s[i] != '}' {
                        i += 1;
                    }
                }
            }
            continue;
        }
        return (vec![prefix], i);
    }
}

/// `path`, as written in the file of module `module`, made absolute and cut to the module it
/// names (`crate::checks::Finding` → `[checks]`); a name a module re-exports (`pub use`) is
/// followed to the module it comes from (`crate::probe::ProbeReport` → `[probe, results]`).
fn resolve(module: &[String], path: &[String], c: &Crate) -> Vec<String> {
    // `super` and `self` count from the file's own module (a `mod.rs` is its directory's).
    let mut at: Vec<String> = module.to_vec();
    let mut rest = path;
    match path.first().map(String::as_str) {
        Some("crate") => {
            at.clear();
            rest = &path[1..];
        }
        Some("self") => rest = &path[1..],
        _ => {}
    }
    while rest.first().map(String::as_str) == Some("super") {
        at.pop();
        rest = &rest[1..];
    }
    at.extend(rest.iter().cloned());
    absolute(at, c)
}

/// An absolute path cut to the module it names, through re-exports.
fn absolute(mut at: Vec<String>, c: &Crate) -> Vec<String> {
    for _ in 0..8 {
        let mut m = at.clone();
        while !m.is_empty() && !c.modules.contains(&m) {
            m.pop();
        }
        match at.get(m.len()).and_then(|name| c.reexports.get(&(m.clone(), name.clone()))) {
            Some(from) if *from != m => at = from.clone(),
            _ => return m,
        }
    }
    at
}

/// What a module's `pub use` lines re-export: `(module, name)` → the module the name comes from.
fn reexports(
    files: &[(Vec<String>, String, String)],
    modules: &BTreeSet<Vec<String>>,
) -> BTreeMap<(Vec<String>, String), Vec<String>> {
    let mut out = BTreeMap::new();
    for (module, _, code) in files {
        for part in code.split("pub use ").chain(code.split("pub(crate) use ")).skip(1) {
            let chars: Vec<char> = part.chars().collect();
            let (found, _) = path_at(&chars, 0);
            for p in found {
                let Some(name) = p.last().cloned() else { continue };
                let mut from: Vec<String> = module.iter().cloned().chain(p).collect();
                while !from.is_empty() && !modules.contains(&from) {
                    from.pop();
                }
                out.insert((module.clone(), name), from);
            }
        }
    }
    out
}

struct Crate {
    /// Each file: its module path, its path for messages, its code.
    files: Vec<(Vec<String>, String, String)>,
    modules: BTreeSet<Vec<String>>,
    reexports: BTreeMap<(Vec<String>, String), Vec<String>>,
}

fn read_crate() -> Crate {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    sources(&src, &mut all);
    let mut files = Vec::new();
    let mut modules = BTreeSet::new();
    for p in all {
        let rel = p.strip_prefix(&src).unwrap().to_path_buf();
        if ROOTS.iter().any(|r| rel == Path::new(r)) {
            continue;
        }
        let module = module_of(&rel);
        let text = std::fs::read_to_string(&p).unwrap();
        modules.insert(module.clone());
        files.push((module, rel.display().to_string(), code(&text)));
    }
    let reexports = reexports(&files, &modules);
    Crate { files, modules, reexports }
}

#[test]
fn every_room_has_its_place_and_imports_go_down() {
    let c = read_crate();
    let mut wrong = Vec::new();
    for (module, file, code) in &c.files {
        let room = &module[0];
        let Some(here) = level(room) else {
            wrong.push(format!("{file}: room `{room}` has no place in tests/rooms.rs ROOMS"));
            continue;
        };
        let used: BTreeSet<String> = paths(code)
            .iter()
            .map(|p| resolve(module, p, &c))
            .filter_map(|m| m.first().cloned())
            .filter(|r| r != room)
            .collect();
        for other in used {
            match level(&other) {
                Some(there) if there < here => {}
                Some(there) if there == here => {
                    wrong.push(format!("{file}: `{room}` uses `{other}`, a room beside it"))
                }
                Some(_) => wrong.push(format!("{file}: `{room}` uses `{other}`, a room above it")),
                None => wrong.push(format!("{file}: `{room}` uses `{other}`, which has no place in ROOMS")),
            }
        }
    }
    assert!(wrong.is_empty(), "imports against the rooms' order:\n{}", wrong.join("\n"));
}

#[test]
fn no_two_modules_of_a_room_import_each_other() {
    let c = read_crate();
    // Edges between the children of one module: `a` → `b` when code in `a` (or below it) uses
    // `b` (or something below it). A parent using its children, or a child its parent, is the
    // ordinary shape of a module and no edge.
    let mut edges: BTreeMap<Vec<String>, BTreeSet<(String, String)>> = BTreeMap::new();
    for (module, _, code) in &c.files {
        for p in paths(code) {
            let target = resolve(module, &p, &c);
            let common = module.iter().zip(&target).take_while(|(a, b)| a == b).count();
            if common < module.len() && common < target.len() {
                let parent = module[..common].to_vec();
                edges.entry(parent).or_default().insert((module[common].clone(), target[common].clone()));
            }
        }
    }
    let mut circles = Vec::new();
    for (parent, e) in &edges {
        let next = |from: &str| -> Vec<&str> { e.iter().filter(|(a, _)| a == from).map(|(_, b)| b.as_str()).collect() };
        // Depth-first from each child: a path back to where it started is a circle.
        for (start, _) in e {
            let mut stack: Vec<Vec<&str>> = vec![vec![start.as_str()]];
            let mut seen = BTreeSet::new();
            while let Some(trail) = stack.pop() {
                let last = trail[trail.len() - 1];
                for n in next(last) {
                    if n == start {
                        // Said once, from its first member in name order.
                        let mut t = trail.clone();
                        let first = (0..t.len()).min_by_key(|i| t[*i]).unwrap_or(0);
                        t.rotate_left(first);
                        t.push(t[0]);
                        let room = if parent.is_empty() {
                            "the crate".to_string()
                        } else {
                            format!("`{}`", parent.join("::"))
                        };
                        circles.push(format!("in {room}: {}", t.join(" → ")));
                    } else if seen.insert(n) {
                        let mut t = trail.clone();
                        t.push(n);
                        stack.push(t);
                    }
                }
            }
        }
    }
    circles.sort();
    circles.dedup();
    assert!(circles.is_empty(), "modules that import each other:\n{}", circles.join("\n"));
}

/// The reading this test stands on: groups, nested groups, `super` chains, comments, and an
/// inline test module left out.
#[test]
fn paths_are_read_as_the_compiler_reads_them() {
    let text = "use super::{fabric, gpu_label as label, x::{a, b}};\n\
                let v = crate::collect::nvml::GPM_FIELDS; // crate::serve\n\
                super::super::nvml::gpu_label(g)\n\
                #[cfg(test)]\n\
                mod tests {\n\
                use crate::cli::Cli;\n\
                }";
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        paths(&code(text)),
        vec![
            s(&["super", "fabric"]),
            s(&["super", "gpu_label"]),
            s(&["super", "x", "a"]),
            s(&["super", "x", "b"]),
            s(&["crate", "collect", "nvml", "GPM_FIELDS"]),
            s(&["super", "super", "nvml", "gpu_label"]),
        ]
    );
    let modules: BTreeSet<Vec<String>> =
        [s(&["checks"]), s(&["checks", "nvml"]), s(&["checks", "xid"]), s(&["probe"]), s(&["probe", "results"])].into();
    let files = vec![(s(&["probe"]), String::new(), code("pub use results::{Outcome, ProbeReport};"))];
    let c = Crate { reexports: reexports(&files, &modules), files, modules };
    let at = s(&["checks", "xid", "sxid"]);
    assert_eq!(resolve(&at, &s(&["super", "super", "nvml", "gpu_label"]), &c), s(&["checks", "nvml"]));
    assert_eq!(resolve(&at, &s(&["crate", "checks", "Finding"]), &c), s(&["checks"]));
    assert_eq!(resolve(&at, &s(&["crate", "probe", "ProbeReport"]), &c), s(&["probe", "results"]));
}
