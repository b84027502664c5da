//! The probes' PTX kernels assemble for Hopper: `ptxas -arch=sm_90` on the text the agent embeds,
//! so a syntax, type or register error is caught without a GPU (the driver's JIT would only
//! refuse it on the tenant's machine). `scripts/test` fetches ptxas from NVIDIA's
//! `nvidia-cuda-nvcc-cu12` wheel into `target/ptxas`; `PHQ_PTXAS` names another.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("PHQ_PTXAS") {
        return Some(PathBuf::from(p));
    }
    let fetched = common::repo().join("target/ptxas/nvidia/cuda_nvcc/bin/ptxas");
    if fetched.is_file() {
        return Some(fetched);
    }
    common::have("ptxas").then(|| PathBuf::from("ptxas"))
}

const KERNELS: &str = "src/probe/kernels.ptx";

#[test]
fn kernels_assemble_for_sm_90() {
    let Some(ptxas) = ptxas() else {
        common::skip("needs ptxas (scripts/test fetches it from the nvidia-cuda-nvcc-cu12 wheel; or set PHQ_PTXAS)");
        return;
    };
    let src = common::repo().join(KERNELS);
    let out = tempfile::tempdir().expect("tempdir");
    let cubin = out.path().join("kernels.cubin");
    let run = Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(&cubin)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", ptxas.display()));
    let said = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "ptxas refused {KERNELS}:\n{said}");
    // Every entry was compiled, and none spills (a spill in a bandwidth kernel costs HBM traffic).
    let text = std::fs::read_to_string(&src).expect("kernels");
    let entries: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix(".visible .entry ")).map(|l| l.trim_end_matches('(')).collect();
    assert!(entries.len() >= 5, "entries: {entries:?}");
    for e in &entries {
        assert!(said.contains(&format!("Compiling entry function '{e}' for 'sm_90'")), "{e} not compiled:\n{said}");
    }
    assert!(
        !said.contains("bytes spill stores")
            || said.matches(" 0 bytes spill stores").count() == said.matches("bytes spill stores").count(),
        "a kernel spills:\n{said}"
    );
}
