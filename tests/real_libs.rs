//! NVIDIA's own libraries against the agent and its fakes, on a machine without a GPU: the
//! driver's libcuda and libnvidia-ml (Debian 12's non-free R535) and the CUDA 12.9 wheels'
//! cuBLAS, NCCL and headers, which `scripts/fetch-nvidia-libs` puts in a cache outside the
//! checkout (docs/testing.md, "NVIDIA's own libraries").
//!
//! - every symbol the agent binds (the `api!` tables of src/cuda/) is exported by the library it
//!   names, and every C function a fake exports by the library it stands for;
//! - every number the agent and the fakes hard-code is the header's, read from the header here;
//! - the real binary against the real libraries: `doctor` and `probe` on this GPU-less machine
//!   say what is missing, in time, without a crash; `probe` on the fake driver with the real
//!   cuBLAS and NCCL runs its GEMMs on the agent's kernels and reports NCCL's failed start.
//!
//! Without the cache each test skips, saying so (under CI it fails).

mod common;

use common::{fake_cuda, fake_nvml, needs, repo, skip};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// The cache `scripts/fetch-nvidia-libs` fills (its header says how it is chosen).
fn cache() -> PathBuf {
    if let Some(p) = std::env::var_os("PHQ_NVIDIA_LIBS") {
        return PathBuf::from(p);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"));
    base.join("phq-agent/nvidia-libs")
}

/// The files of the real libraries the tests read.
struct Real {
    libcuda: PathBuf,
    libnvml: PathBuf,
    cublas: PathBuf,
    nccl: PathBuf,
    cuda_h: PathBuf,
    library_types_h: PathBuf,
    cublas_api_h: PathBuf,
    nccl_h: PathBuf,
    nvml_h: PathBuf,
}

/// `rel` inside the cache's complete directory whose name starts with `package-`.
fn in_cache(package: &str, rel: &str) -> Result<PathBuf, String> {
    let dir = cache();
    let entries = std::fs::read_dir(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut found: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with(&format!("{package}-")) && p.join(".done").is_file()
        })
        .map(|p| p.join(rel))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found.pop().ok_or_else(|| format!("no {package}-*/{rel} under {}", dir.display()))
}

/// The real libraries, or a skip saying how to fetch them.
#[track_caller]
fn real() -> Option<Real> {
    let driver = "usr/lib/x86_64-linux-gnu/nvidia/current";
    let all = || -> Result<Real, String> {
        Ok(Real {
            libcuda: in_cache("libcuda1", &format!("{driver}/libcuda.so.1"))?,
            libnvml: in_cache("libnvidia-ml1", &format!("{driver}/libnvidia-ml.so.1"))?,
            cublas: in_cache("nvidia-cublas-cu12", "nvidia/cublas/lib/libcublas.so.12")?,
            nccl: in_cache("nvidia-nccl-cu12", "nvidia/nccl/lib/libnccl.so.2")?,
            cuda_h: in_cache("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/include/cuda.h")?,
            library_types_h: in_cache("nvidia-cuda-runtime-cu12", "nvidia/cuda_runtime/include/library_types.h")?,
            cublas_api_h: in_cache("nvidia-cublas-cu12", "nvidia/cublas/include/cublas_api.h")?,
            nccl_h: in_cache("nvidia-nccl-cu12", "nvidia/nccl/include/nccl.h")?,
            nvml_h: in_cache("nvidia-nvml-dev-cu12", "nvidia/nvml_dev/include/nvml.h")?,
        })
    };
    match all() {
        Ok(r) => Some(r),
        Err(why) => {
            skip(&format!("NVIDIA's libraries are not fetched ({why}): run scripts/fetch-nvidia-libs"));
            None
        }
    }
}

/// The functions a shared library exports (`nm -D --defined-only`), without symbol versions.
fn exports(lib: &Path) -> BTreeSet<String> {
    let out = Command::new("nm").args(["-D", "--defined-only"]).arg(lib).output().expect("run nm");
    assert!(out.status.success(), "nm -D {}: {}", lib.display(), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (kind, name) = (f.nth(1)?, f.next()?);
            (kind == "T" || kind == "W" || kind == "i").then(|| name.split('@').next().unwrap_or(name).to_string())
        })
        .collect()
}

/// The functions each `api!` table of `file` binds: table name → symbols.
fn bound(file: &str) -> BTreeMap<String, Vec<String>> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    let mut tables = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("api!(") {
            let name = t.trim_end_matches('{').trim().rsplit(',').next().unwrap().trim().to_string();
            current = Some(name);
        } else if t == "});" {
            current = None;
        } else if let Some(table) = &current {
            if let Some((name, rest)) = t.split_once(':') {
                if rest.trim_start().starts_with("fn(") {
                    tables.entry(table.clone()).or_insert_with(Vec::new).push(name.trim().to_string());
                }
            }
        }
    }
    tables
}

#[test]
fn every_symbol_the_agent_binds_is_exported_by_nvidias_library() {
    let Some(r) = real() else { return };
    if !needs(&[("nm", "binutils")]) {
        return;
    }
    let mut tables = bound("src/cuda/driver.rs");
    tables.extend(bound("src/cuda/nccl.rs"));
    let libs = [("DriverApi", &r.libcuda), ("BlasApi", &r.cublas), ("NcclApi", &r.nccl)];
    assert_eq!(tables.keys().collect::<Vec<_>>(), ["BlasApi", "DriverApi", "NcclApi"], "the tables read");
    for (table, lib) in libs {
        let have = exports(lib);
        let missing: Vec<&String> = tables[table].iter().filter(|s| !have.contains(*s)).collect();
        assert!(missing.is_empty(), "{table}: {} exports none of {missing:?}", lib.display());
        assert!(tables[table].len() >= 5, "{table}: {:?}", tables[table]);
    }
}

/// The functions a header declares (`CUresult CUDAAPI cuInit(`, `nvmlReturn_t DECLDIR
/// nvmlInit_v2(`): each word before an opening parenthesis that follows a calling-convention
/// macro.
fn declared(header: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(header).unwrap();
    let mut out = BTreeSet::new();
    for (i, _) in text.match_indices('(') {
        let before = &text[..i];
        let len = before.chars().rev().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').count();
        let (rest, name) = before.split_at(before.len() - len);
        if !name.is_empty() && ["CUDAAPI", "DECLDIR"].iter().any(|m| rest.trim_end().ends_with(m)) {
            out.insert(name.to_string());
        }
    }
    out
}

/// Each fake exports only functions the library it stands for has: a fake cannot hand the agent
/// a call the real library lacks. The Debian driver is R535 (CUDA 12.2) and the fakes stand for
/// newer drivers too, so a function the CUDA 12.9 headers declare counts as well
/// (`cuEventElapsedTime_v2`, CUDA 12.8's). The fake NVML exports the NVML functions the agent
/// calls through nvml-wrapper (its header), so this also holds the agent's NVML calls to the real
/// libnvidia-ml.
#[test]
fn every_function_a_fake_exports_is_in_the_library_it_stands_for() {
    let Some(r) = real() else { return };
    if !needs(&[("nm", "binutils")]) {
        return;
    }
    let with = |mut lib: BTreeSet<String>, header: &Path| {
        lib.extend(declared(header));
        lib
    };
    let cuda = with(exports(&r.libcuda), &r.cuda_h);
    let (cublas, nccl, nvml) = (exports(&r.cublas), exports(&r.nccl), with(exports(&r.libnvml), &r.nvml_h));
    let mut checked = 0;
    for (fake, stands_for) in
        [(fake_cuda(), vec![("cublas", &cublas), ("nccl", &nccl), ("cu", &cuda)]), (fake_nvml(), vec![("nvml", &nvml)])]
    {
        for name in exports(fake) {
            let Some((prefix, real)) = stands_for.iter().find(|(p, _)| name.starts_with(p)) else {
                continue;
            };
            assert!(
                real.contains(&name),
                "{} exports {name}, which NVIDIA's {prefix} library does not",
                fake.display()
            );
            checked += 1;
        }
    }
    assert!(checked > 60, "only {checked} functions compared");
}

/// A C integer literal: `12`, `-1`, `0x02`, `0x0000000000000001LL`.
fn literal(v: &str) -> Option<i64> {
    let v = v.trim().trim_matches(|c| c == '(' || c == ')').trim_end_matches(['u', 'U', 'l', 'L']);
    let (neg, v) = v.strip_prefix('-').map_or((false, v), |v| (true, v));
    let n = match v.strip_prefix("0x").or_else(|| v.strip_prefix("0X")) {
        Some(h) => i64::from_str_radix(h, 16).ok()?,
        None => v.parse().ok()?,
    };
    Some(if neg { -n } else { n })
}

/// C source without its comments.
fn uncommented(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        match (rest.find("/*"), rest.find("//")) {
            (Some(b), l) if l.is_none_or(|l| b < l) => {
                out.push_str(&rest[..b]);
                rest = rest[b..].find("*/").map_or("", |e| &rest[b + e + 2..]);
            }
            (_, Some(l)) => {
                out.push_str(&rest[..l]);
                rest = rest[l..].find('\n').map_or("", |e| &rest[l + e..]);
            }
            _ => {
                out.push_str(rest);
                rest = "";
            }
        }
    }
    out
}

/// Every enumerator of a header (implicit values counted as C counts them, one enumerator
/// naming another resolved) and every `#define NAME number` (or `#define NAME OTHER_NAME`).
fn numbers(header: &Path) -> BTreeMap<String, i64> {
    let text = uncommented(&std::fs::read_to_string(header).unwrap());
    let mut out: BTreeMap<String, i64> = BTreeMap::new();
    let mut aliases: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        let mut f = line.split_whitespace();
        if let (Some("#define"), Some(name), Some(value), None) = (f.next(), f.next(), f.next(), f.next()) {
            match literal(value) {
                Some(n) => {
                    out.insert(name.to_string(), n);
                }
                None => aliases.push((name.to_string(), value.to_string())),
            }
        }
    }
    let is_name = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    for (at, _) in text.match_indices("enum") {
        let rest = &text[at + 4..];
        let Some(open) = rest.find('{') else { continue };
        // Only `enum [name] {`: not a use of an enum type.
        if !rest[..open].trim().chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let Some(close) = rest[open..].find('}') else { continue };
        let mut next = 0i64;
        for entry in rest[open + 1..open + close].split(',') {
            let (name, value) = match entry.split_once('=') {
                Some((n, v)) => (n.trim(), Some(v.trim())),
                None => (entry.trim(), None),
            };
            if !is_name(name) {
                continue;
            }
            let v = match value {
                None => Some(next),
                Some(v) => literal(v).or_else(|| out.get(v).copied()),
            };
            if let Some(v) = v {
                out.entry(name.to_string()).or_insert(v);
                next = v + 1;
            }
        }
    }
    for _ in 0..4 {
        for (name, to) in &aliases {
            if let Some(v) = out.get(to).copied() {
                out.entry(name.clone()).or_insert(v);
            }
        }
    }
    out
}

/// Asserts `ours` (name in the header → our value, and where ours is written) against `header`.
#[track_caller]
fn same(header: &BTreeMap<String, i64>, what: &Path, ours: &[(String, i64, &str)]) {
    let wrong: Vec<String> = ours
        .iter()
        .filter(|(name, v, _)| header.get(name) != Some(v))
        .map(|(name, v, at)| format!("{at}: {name} = {v}, {} says {:?}", what.display(), header.get(name)))
        .collect();
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(!ours.is_empty(), "nothing compared against {}", what.display());
}

/// `SCREAMING_CASE` → `ScreamingCase`.
fn camel(s: &str) -> String {
    s.split('_')
        .map(|w| {
            let mut c = w.chars();
            c.next().map(|f| f.to_ascii_uppercase().to_string() + &c.as_str().to_ascii_lowercase()).unwrap_or_default()
        })
        .collect()
}

/// Every source file of both fakes but their tests, relative to the repository.
fn fake_sources() -> Vec<String> {
    let mut out = Vec::new();
    for dir in ["crates/fake-cuda/src", "crates/fake-nvml/src"] {
        for e in std::fs::read_dir(repo().join(dir)).unwrap() {
            let name = e.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".rs") && !name.starts_with("tests") {
                out.push(format!("{dir}/{name}"));
            }
        }
    }
    out.sort();
    out
}

/// Each `const NAME: TYPE = N;` of a fake's source with `TYPE` among `types`: name, type, N.
fn consts(file: &str, types: &[&str]) -> Vec<(String, String, i64)> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    text.lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = ["pub(crate) ", "pub(super) ", "pub "].iter().find_map(|p| l.strip_prefix(p)).unwrap_or(l);
            let l = l.strip_prefix("const ")?;
            let (name, rest) = l.split_once(':')?;
            let (ty, value) = rest.split_once('=')?;
            let ty = ty.trim();
            if !types.contains(&ty) {
                return None;
            }
            let v = value.trim().trim_end_matches(';').trim();
            let v = match v.strip_prefix("0x") {
                Some(h) => i64::from_str_radix(&h.replace('_', ""), 16).ok()?,
                None => v.replace('_', "").parse().ok()?,
            };
            Some((name.trim().to_string(), ty.to_string(), v))
        })
        .collect()
}

/// `(N, "NAME"` and `("NAME", N)` pairs of a fake's tables.
fn pairs(file: &str) -> Vec<(String, i64)> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    text.lines()
        .filter_map(|l| {
            let l = l.trim().strip_prefix('(')?;
            let mut f = l.splitn(3, ',');
            let (a, b) = (f.next()?.trim(), f.next()?.trim().trim_end_matches(')'));
            let num = |s: &str| match s.strip_prefix("0x") {
                Some(h) => i64::from_str_radix(h, 16).ok(),
                None => s.parse().ok(),
            };
            match (num(a), num(b)) {
                (Some(n), None) => Some((b.trim_matches('"').to_string(), n)),
                (None, Some(n)) => Some((a.trim_matches('"').to_string(), n)),
                _ => None,
            }
        })
        .collect()
}

#[test]
fn every_number_the_agent_hard_codes_is_the_headers() {
    use phq_agent::cuda::{attr, code, driver as d, is_sticky, nccl};
    let Some(r) = real() else { return };
    let cuda_h = numbers(&r.cuda_h);
    let at = "src/cuda/driver.rs";
    let ours = [
        ("CUDA_SUCCESS", code::SUCCESS),
        ("CUDA_ERROR_OUT_OF_MEMORY", code::OUT_OF_MEMORY),
        ("CUDA_ERROR_DEVICE_UNAVAILABLE", code::DEVICE_UNAVAILABLE),
        ("CUDA_ERROR_NO_DEVICE", code::NO_DEVICE),
        ("CUDA_ERROR_ECC_UNCORRECTABLE", code::ECC_UNCORRECTABLE),
        ("CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", code::PEER_ACCESS_ALREADY_ENABLED),
        ("CU_DEVICE_ATTRIBUTE_COMPUTE_MODE", attr::COMPUTE_MODE),
        ("CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT", attr::MULTIPROCESSOR_COUNT),
        ("CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE", attr::L2_CACHE_SIZE),
        ("CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", attr::MULTICAST_SUPPORTED),
        ("CU_MEMHOSTALLOC_PORTABLE", d::CU_MEMHOSTALLOC_PORTABLE as i32),
        ("CU_MEMHOSTALLOC_DEVICEMAP", d::CU_MEMHOSTALLOC_DEVICEMAP as i32),
    ];
    same(&cuda_h, &r.cuda_h, &ours.map(|(n, v)| (n.to_string(), i64::from(v), at)));
    // The errors the driver API reference calls sticky, by the header's numbers.
    for name in [
        "CUDA_ERROR_ECC_UNCORRECTABLE",
        "CUDA_ERROR_NVLINK_UNCORRECTABLE",
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "CUDA_ERROR_HARDWARE_STACK_ERROR",
        "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        "CUDA_ERROR_MISALIGNED_ADDRESS",
        "CUDA_ERROR_INVALID_ADDRESS_SPACE",
        "CUDA_ERROR_INVALID_PC",
        "CUDA_ERROR_LAUNCH_FAILED",
    ] {
        assert!(is_sticky(cuda_h[name] as i32), "{at}: is_sticky({name} = {}) is false", cuda_h[name]);
    }

    let types = numbers(&r.library_types_h);
    let ours = [
        ("CUDA_R_16BF", d::CUDA_R_16BF),
        ("CUDA_R_16F", d::CUDA_R_16F),
        ("CUDA_R_32F", d::CUDA_R_32F),
        ("MAJOR_VERSION", d::LIBRARY_PROPERTIES[0]),
        ("MINOR_VERSION", d::LIBRARY_PROPERTIES[1]),
        ("PATCH_LEVEL", d::LIBRARY_PROPERTIES[2]),
    ];
    same(&types, &r.library_types_h, &ours.map(|(n, v)| (n.to_string(), i64::from(v), at)));

    let cublas_h = numbers(&r.cublas_api_h);
    let ours = [("CUBLAS_COMPUTE_32F", d::CUBLAS_COMPUTE_32F), ("CUBLAS_GEMM_DEFAULT", d::CUBLAS_GEMM_DEFAULT)];
    same(&cublas_h, &r.cublas_api_h, &ours.map(|(n, v)| (n.to_string(), i64::from(v), at)));
    // Every cuBLAS status the header has is named as the header names it.
    let statuses: Vec<(&String, &i64)> =
        cublas_h.iter().filter(|(n, v)| n.starts_with("CUBLAS_STATUS_") && **v != 0).collect();
    assert!(statuses.len() >= 9, "{statuses:?}");
    for (name, v) in statuses {
        assert_eq!(d::blas_status(*v as i32), name, "{at}: blas_status({v})");
    }

    // The NVML return codes the agent names itself (a fabric status arrives as a bare code).
    let nvml_h = numbers(&r.nvml_h);
    let codes: Vec<(&String, &i64)> =
        nvml_h.iter().filter(|(n, _)| *n == "NVML_SUCCESS" || n.starts_with("NVML_ERROR_")).collect();
    let mut named = 0;
    for (name, v) in codes {
        let ours = phq_agent::collect::nvml::return_code_name(*v as u32);
        if ours.starts_with("NVML_") {
            assert_eq!(&ours, name, "src/collect/nvml/mod.rs: return_code_name({v})");
            named += 1;
        }
    }
    assert!(named >= 10, "only {named} NVML codes named");

    let nccl_h = numbers(&r.nccl_h);
    let at = "src/cuda/nccl.rs";
    let ours = [("ncclFloat32", nccl::NCCL_FLOAT32), ("ncclSum", nccl::NCCL_SUM)];
    same(&nccl_h, &r.nccl_h, &ours.map(|(n, v)| (n.to_string(), i64::from(v), at)));
    let results: Vec<(&String, &i64)> = nccl_h
        .iter()
        .filter(|(n, v)| n.starts_with("nccl") && **v != 0 && *n != "ncclNumResults")
        .filter(|(n, _)| ["Error", "Argument", "Usage", "InProgress", "Timeout"].iter().any(|k| n.contains(k)))
        .filter(|(n, _)| !n.starts_with("ncclResult"))
        .collect();
    assert!(results.len() >= 7, "{results:?}");
    for (name, v) in results {
        assert_eq!(nccl::result_name(*v as i32), name, "{at}: result_name({v})");
    }
}

#[test]
fn every_number_the_fakes_hard_code_is_the_headers() {
    let Some(r) = real() else { return };
    let (cuda_h, types_h, cublas_h, nccl_h, nvml_h) = (
        numbers(&r.cuda_h),
        numbers(&r.library_types_h),
        numbers(&r.cublas_api_h),
        numbers(&r.nccl_h),
        numbers(&r.nvml_h),
    );
    // Every integer constant of every source file of both fakes, whatever its file: each is a
    // header's number under the name it maps to, or one of the fakes' own (listed, with why),
    // so a constant added anywhere in a fake is checked or fails here until it is classified.
    let own = [
        ("crates/fake-cuda/src/hang.rs", "BLOCK"), // the fake's marker for a call that blocks
        ("crates/fake-nvml/src/lib.rs", "CODEC_SAMPLING_PERIOD_US"), // the scenario's sampling period
    ];
    let files = fake_sources();
    let (mut in_cuda, mut in_types, mut in_cublas, mut in_nccl, mut in_nvml) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut unclassified = Vec::new();
    let mut seen = 0;
    for file in &files {
        let at = file.as_str();
        for (name, ty, v) in consts(at, &["CUresult", "Status", "NcclResult", "c_int", "c_uint"]) {
            seen += 1;
            if own.contains(&(at, name.as_str())) {
                continue;
            }
            match (ty.as_str(), name.as_str()) {
                ("CUresult", "SUCCESS") => in_cuda.push(("CUDA_SUCCESS".to_string(), v, at)),
                ("CUresult", n) => in_cuda.push((format!("CUDA_ERROR_{n}"), v, at)),
                ("Status", n) => in_cublas.push((format!("CUBLAS_STATUS_{n}"), v, at)),
                ("NcclResult", n) => in_nccl.push((format!("nccl{}", camel(n)), v, at)),
                (_, n) if n.starts_with("CUDA_R_") => in_types.push((name.clone(), v, at)),
                (_, n) if n.starts_with("CUBLAS_") => in_cublas.push((name.clone(), v, at)),
                (_, n) if n.starts_with("CU_") => in_cuda.push((name.clone(), v, at)),
                (_, n) if n.starts_with("NCCL_") => in_nccl.push((format!("nccl{}", camel(&n[5..])), v, at)),
                (_, "VERSION") if file.ends_with("nccl.rs") => in_nccl.push(("NCCL_VERSION_CODE".into(), v, at)),
                (_, n) if n.starts_with("FI_") => in_nvml.push((format!("NVML_{n}"), v, at)),
                (_, n) if n.starts_with("NVML_") => in_nvml.push((name.clone(), v, at)),
                // dlfcn.h's flags, which the fake NVML passes to dlopen: glibc's, as the libc crate has them.
                (_, "RTLD_LAZY") => assert_eq!(v, i64::from(libc::RTLD_LAZY), "{at}: RTLD_LAZY"),
                (_, "RTLD_NOLOAD") => assert_eq!(v, i64::from(libc::RTLD_NOLOAD), "{at}: RTLD_NOLOAD"),
                _ => unclassified.push(format!("{at}: {name} = {v}")),
            }
        }
    }
    assert!(
        unclassified.is_empty(),
        "constants of the fakes no test compares with a header:\n{}",
        unclassified.join("\n")
    );
    assert!(seen >= 40, "only {seen} constants found in the fakes' sources");

    // crates/fake-cuda's tables: its CUresult names and the attributes it answers.
    let at = "crates/fake-cuda/src/codes.rs";
    in_cuda.extend(pairs(at).into_iter().map(|(n, v)| (n, v, at)));
    let driver = std::fs::read_to_string(repo().join("crates/fake-cuda/src/driver.rs")).unwrap();
    let attributes: Vec<(String, i64, &str)> = driver
        .lines()
        .filter_map(|l| {
            let (arm, comment) = l.split_once("//")?;
            let (n, _) = arm.trim().split_once("=>")?;
            let name = comment.split_whitespace().next()?;
            Some((format!("CU_DEVICE_ATTRIBUTE_{name}"), n.trim().parse().ok()?, "crates/fake-cuda/src/driver.rs"))
        })
        .collect();
    assert!(attributes.len() >= 8, "{attributes:?}");
    in_cuda.extend(attributes);
    same(&cuda_h, &r.cuda_h, &in_cuda);
    same(&types_h, &r.library_types_h, &in_types);
    same(&cublas_h, &r.cublas_api_h, &in_cublas);
    same(&nccl_h, &r.nccl_h, &in_nccl);

    // crates/fake-nvml's tables: its return codes and clock-event (throttle) reasons.
    let at = "crates/fake-nvml/src/lib.rs";
    for (name, v) in pairs(at) {
        if name.starts_with("NVML_") {
            in_nvml.push((name, v, at));
        } else {
            in_nvml.push((format!("nvmlClocksThrottleReason{}", camel(&name)), v, at));
        }
    }
    assert!(in_nvml.len() >= 30, "{in_nvml:?}");
    same(&nvml_h, &r.nvml_h, &in_nvml);
}

/// The agent's command. NVIDIA's libnvidia-ml and libcuda, run as root on a machine without the
/// driver, make the device nodes they miss (/dev/nvidiactl): as root the test takes away
/// CAP_MKNOD (`setpriv`, util-linux), so it leaves the machine's /dev as it found it.
fn agent_command() -> Command {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        let mut c = Command::new("setpriv");
        c.args(["--bounding-set", "-mknod", "--", env!("CARGO_BIN_EXE_phq-agent")]);
        c
    } else {
        Command::new(env!("CARGO_BIN_EXE_phq-agent"))
    }
}

/// Whether an NVIDIA driver is loaded here (its /proc directory, which no library makes).
fn driver_loaded() -> bool {
    Path::new("/proc/driver/nvidia").exists()
}

/// `phq-agent` with the real libraries, no fake: the JSON report, the exit code, the wall time.
fn agent(args: &[&str], envs: &[(&str, &Path)]) -> (i32, Value, String, Duration) {
    let mut c = agent_command();
    c.args(args).env_remove("PHQ_FAKE_CUDA_SCENARIO").env_remove("PHQ_FAKE_NVML_SCENARIO");
    for (k, v) in envs {
        c.env(k, v);
    }
    let started = Instant::now();
    let out = c.output().expect("run phq-agent");
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let report = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stderr}"));
    (out.status.code().unwrap_or(-1), report, stderr, took)
}

fn finding<'a>(report: &'a Value, id: &str) -> &'a Value {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {:#}", report["findings"]))
}

/// On a machine with no GPU and no kernel module, the real libnvidia-ml and libcuda load and
/// refuse: `doctor` names both failures as theirs (NVML: driver not loaded; CUDA: no device),
/// and `probe` says the probes cannot run, each well within a minute.
#[test]
fn doctor_and_probe_with_the_real_driver_libraries_name_what_is_missing() {
    let Some(r) = real() else { return };
    if driver_loaded() {
        skip("this machine has an NVIDIA driver loaded: the GPU-less answers cannot be seen here");
        return;
    }
    let nodes_before = Path::new("/dev/nvidiactl").exists();
    let sysroot = repo().join("tests/fixtures/sysroots/h200-single");
    let config = repo().join("tests/fixtures/config/empty/config.toml");
    let (s, c, n, l) =
        (sysroot.to_str().unwrap(), config.to_str().unwrap(), r.libnvml.to_str().unwrap(), r.libcuda.to_str().unwrap());
    let (code, report, stderr, took) =
        agent(&["doctor", "--json", "--sysroot", s, "--config", c, "--nvml-lib", n, "--cuda-lib", l], &[]);
    assert_eq!(code, 2, "{stderr}");
    let nvml = finding(&report, "nvml.init");
    assert_eq!(nvml["severity"], "fail", "{nvml}");
    assert_eq!(nvml["evidence"]["kind"], "driver_not_loaded", "{nvml}");
    let cuda = finding(&report, "cuda.init");
    assert_ne!(cuda["severity"], "pass", "{cuda}");
    assert!(cuda.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{cuda}");
    assert!(took < Duration::from_secs(60), "doctor took {took:?}");

    let state = tempfile::tempdir().unwrap();
    let cfg = state.path().join("config.toml");
    std::fs::write(&cfg, format!("[agent]\nstate_dir = {:?}\n", state.path().join("state"))).unwrap();
    let (code, report, stderr, took) = agent(
        &["probe", "--json", "--sysroot", s, "--config", cfg.to_str().unwrap(), "--nvml-lib", n, "--cuda-lib", l],
        &[],
    );
    assert!(code == 2 || code == 3, "{code}: {stderr}");
    let gemm = finding(&report, "probe.gemm");
    assert_eq!(gemm["severity"], "unknown", "{gemm}");
    assert!(gemm.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{gemm}");
    assert!(took < Duration::from_secs(60), "probe took {took:?}");
    assert!(nodes_before || !Path::new("/dev/nvidiactl").exists(), "the test made /dev/nvidiactl");
}

/// The fake driver's GPUs with NVIDIA's own cuBLAS and NCCL: their CUDA runtime finds no driver
/// it can start on (the fake is no libcuda.so.1 on the loader's path), so `cublasCreate` answers
/// CUBLAS_STATUS_NOT_INITIALIZED and `ncclCommInitAll` fails. The GEMMs pass on the agent's own
/// kernels with `probe.cublas` naming cuBLAS's failure and version; `probe.nccl-start` says NCCL
/// did not start, with its version — not a fault of the GPUs or the links.
#[test]
fn probe_on_the_fake_driver_with_the_real_cublas_and_nccl() {
    let Some(r) = real() else { return };
    if driver_loaded() {
        skip("this machine has an NVIDIA driver loaded: NVIDIA's cuBLAS would start on it");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("config.toml");
    std::fs::write(&cfg, format!("[agent]\nstate_dir = {:?}\n", dir.path().join("state"))).unwrap();
    let sysroot = repo().join("tests/fixtures/sysroots/hgx-8gpu-healthy");
    let nvml = repo().join("examples/scenarios/hgx-8gpu-healthy.json");
    let cuda = repo().join("examples/scenarios/cuda-hgx-8gpu.json");
    let mut c = agent_command();
    c.args(["probe", "--json", "--gpu", "0", "--gpu", "1", "--allreduce-size", "64M", "--config"])
        .arg(&cfg)
        .arg("--sysroot")
        .arg(&sysroot)
        .arg("--nvml-lib")
        .arg(fake_nvml())
        .arg("--cuda-lib")
        .arg(fake_cuda())
        .env("PHQ_FAKE_NVML_SCENARIO", &nvml)
        .env("PHQ_FAKE_CUDA_SCENARIO", &cuda)
        .env("PHQ_CUBLAS_LIB", &r.cublas)
        .env("PHQ_NCCL_LIB", &r.nccl)
        .env_remove("CUDA_DEVICE_ORDER");
    let out = c.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!stderr.contains("panicked"), "{stderr}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {stderr}"));
    let gemms: Vec<&Value> =
        report["findings"].as_array().unwrap().iter().filter(|f| f["id"] == "probe.gemm").collect();
    assert_eq!(gemms.len(), 2, "{stderr}");
    for f in gemms {
        assert_eq!(f["severity"], "pass", "{f}");
        assert_eq!(f["evidence"]["gemm"]["library"], "PTX fallback (phq_sgemm)", "{f}");
    }
    let c = finding(&report, "probe.cublas");
    assert_eq!(c["severity"], "warn", "{c}");
    let detail = c["detail"].as_str().unwrap();
    assert!(detail.contains("cuBLAS 12.9.1") && detail.contains("CUBLAS_STATUS_NOT_INITIALIZED"), "{c}");
    let n = finding(&report, "probe.nccl-start");
    assert_eq!(n["severity"], "warn", "{n}");
    assert!(n["summary"].as_str().unwrap().contains("NCCL 2.27.3"), "{n}");
    assert!(n["summary"].as_str().unwrap().contains("ncclCommInitAll"), "{n}");
    // NCCL's own reason, the words the fake's `needs_driver_version` repeats.
    let said = n["evidence"]["nccl_warning"].as_str().unwrap_or_default();
    assert_eq!(said, "Cuda failure 'CUDA driver version is insufficient for CUDA runtime version'", "{n}");
    assert_eq!(finding(&report, "probe.allreduce")["severity"], "unknown");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
}

/// `serve` with the real libnvidia-ml and libcuda on this GPU-less machine: `READY=1` in time,
/// `/healthz` unhealthy with NVML's reason, the report's `nvml.init` naming the missing driver,
/// and nothing crashed: the libraries load, refuse, and the service says so.
#[test]
fn serve_with_the_real_driver_libraries_is_ready_and_says_why_it_is_unhealthy() {
    use std::os::unix::net::UnixDatagram;
    const TOKEN: &str = "tok-real-libs-0000";
    let Some(r) = real() else { return };
    if driver_loaded() {
        skip("this machine has an NVIDIA driver loaded: the GPU-less answers cannot be seen here");
        return;
    }
    let Some(bus) = common::PrivateBus::start(common::HEALTHY_UNITS) else { return };
    let dir = tempfile::tempdir().unwrap();
    let cfg = common::service_config(dir.path(), TOKEN, "");
    let notify_path = dir.path().join("notify");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = agent_command();
    c.args(["serve", "--config"])
        .arg(&cfg)
        .arg("--sysroot")
        .arg(repo().join("tests/fixtures/sysroots/h200-single"))
        .arg("--nvml-lib")
        .arg(&r.libnvml)
        .arg("--cuda-lib")
        .arg(&r.libcuda)
        .env("DBUS_SYSTEM_BUS_ADDRESS", &bus.address)
        .env("NOTIFY_SOCKET", &notify_path)
        .env_remove("PHQ_FAKE_NVML_SCENARIO")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let started = Instant::now();
    let mut child = c.spawn().unwrap();
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let port = common::listening_port(&mut child);
    let _child = Kill(child);
    let port = port.expect("serve listens");
    let mut buf = [0u8; 4096];
    let mut messages = String::new();
    while !messages.contains("READY=1") {
        let n = notify.recv(&mut buf).expect("READY=1 within a minute");
        messages.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    assert!(started.elapsed() < Duration::from_secs(60), "READY=1 after {:?}", started.elapsed());
    let (status, body) = common::get_with_token(port, "/healthz", "");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("unhealthy"), "{body}");
    let (status, body) = common::get_with_token(port, "/v1/status", TOKEN);
    assert_eq!(status, 200, "{body}");
    let report: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(finding(&report, "nvml.init")["evidence"]["kind"], "driver_not_loaded", "{body}");
    assert!(finding(&report, "cuda.init").to_string().contains("CUDA_ERROR_NO_DEVICE"), "{body}");
}
