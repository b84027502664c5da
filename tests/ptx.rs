//! The probes' PTX kernels assemble for Hopper: `ptxas -arch=sm_90` on the text the agent embeds,
//! so a syntax, type or register error is caught without a GPU (the driver's JIT would only
//! refuse it on the tenant's machine). `scripts/test` fetches ptxas from NVIDIA's
//! `nvidia-cuda-nvcc-cu12` wheel into `target/ptxas`; `PHQ_PTXAS` names another.

mod common;

use std::path::PathBuf;
use std::process::Command;

/// A tool of NVIDIA's: the one `var` names, else the one `scripts/test` unpacked at `fetched`
/// (under the repository), else one on PATH.
fn tool(var: &str, fetched: &str, name: &str) -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(var) {
        return Some(PathBuf::from(p));
    }
    let fetched = common::repo().join(fetched);
    if fetched.is_file() {
        return Some(fetched);
    }
    common::have(name).then(|| PathBuf::from(name))
}

fn ptxas() -> Option<PathBuf> {
    tool("PHQ_PTXAS", "target/ptxas/nvidia/cuda_nvcc/bin/ptxas", "ptxas")
}

const KERNELS: &str = "src/probe/kernels.ptx";
/// The tensor-core module (sm_80 and later).
const TENSOR: &str = "src/probe/tensor.ptx";

fn nvdisasm() -> Option<PathBuf> {
    tool("PHQ_NVDISASM", "target/nvdisasm/nvidia/cu13/bin/nvdisasm", "nvdisasm")
}

/// The memory-test kernels read and write every word of 90% of the GPU's memory: a call per
/// word (the pattern as a `.func`) cost a real CALL and return per word in the machine code and
/// kept one load in flight; the GEMM check's 64-bit div and rem were four called subroutines
/// per entry. Read from the code ptxas makes for Hopper: no CALL in any of them.
#[test]
fn memory_test_kernels_call_no_function() {
    let (Some(ptxas), Some(nvdisasm)) = (ptxas(), nvdisasm()) else {
        common::skip(
            "needs ptxas and nvdisasm (scripts/test fetches them from NVIDIA's wheels; or set PHQ_PTXAS, PHQ_NVDISASM)",
        );
        return;
    };
    let out = tempfile::tempdir().expect("tempdir");
    let cubin = out.path().join("kernels.cubin");
    let run = Command::new(&ptxas)
        .args(["-arch=sm_90", "-o"])
        .arg(&cubin)
        .arg(common::repo().join(KERNELS))
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let dis = Command::new(&nvdisasm).arg(&cubin).output().unwrap_or_else(|e| panic!("{}: {e}", nvdisasm.display()));
    assert!(dis.status.success(), "{}", String::from_utf8_lossy(&dis.stderr));
    let text = String::from_utf8_lossy(&dis.stdout);
    // The GEMM check reads every entry of C too: its index arithmetic in 32 bits, no helper.
    for entry in ["phq_mem_write", "phq_mem_check", "phq_gemm_check"] {
        let head = format!(".text.{entry}:");
        let body = text.split(&head).nth(1).unwrap_or_else(|| panic!("no {head} in the disassembly"));
        let body = body.split("\n.text.").next().unwrap_or(body);
        let calls: Vec<&str> = body.lines().filter(|l| l.contains("CALL")).collect();
        assert!(calls.is_empty(), "{entry} calls a function in its machine code: {calls:#?}");
        assert!(body.contains("LDG") || body.contains("STG"), "{entry}: no global access found; not its code?");
    }
}

/// The tensor-core GEMM is what its name says: ptxas turns each `mma.sync` into Hopper's
/// half-precision matrix instruction (HMMA), not into a loop on the CUDA cores.
#[test]
fn the_tensor_gemm_runs_on_the_tensor_cores() {
    let (Some(ptxas), Some(nvdisasm)) = (ptxas(), nvdisasm()) else {
        common::skip(
            "needs ptxas and nvdisasm (scripts/test fetches them from NVIDIA's wheels; or set PHQ_PTXAS, PHQ_NVDISASM)",
        );
        return;
    };
    let out = tempfile::tempdir().expect("tempdir");
    let cubin = out.path().join("tensor.cubin");
    let run =
        Command::new(&ptxas).args(["-arch=sm_90", "-o"]).arg(&cubin).arg(common::repo().join(TENSOR)).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let dis = Command::new(&nvdisasm).arg(&cubin).output().unwrap_or_else(|e| panic!("{}: {e}", nvdisasm.display()));
    let text = String::from_utf8_lossy(&dis.stdout);
    let hmma: Vec<&str> = text.lines().filter(|l| l.contains("HMMA.16816.F32.BF16")).collect();
    assert!(!hmma.is_empty(), "no BF16 HMMA in phq_mma_gemm's machine code:\n{text}");
    // The FP16 branch: an HMMA of the same shape without the BF16 suffix (SASS names FP16 by
    // default).
    let f16: Vec<&str> = text.lines().filter(|l| l.contains("HMMA.16816.F32 ")).collect();
    assert!(!f16.is_empty(), "no FP16 HMMA in phq_mma_gemm's machine code:\n{text}");
}

#[test]
fn kernels_assemble_for_sm_90() {
    for module in [KERNELS, TENSOR] {
        assemble(module);
    }
}

fn assemble(module: &str) {
    let Some(ptxas) = ptxas() else {
        common::skip("needs ptxas (scripts/test fetches it from the nvidia-cuda-nvcc-cu12 wheel; or set PHQ_PTXAS)");
        return;
    };
    let src = common::repo().join(module);
    let out = tempfile::tempdir().expect("tempdir");
    let cubin = out.path().join("kernels.cubin");
    let run = Command::new(&ptxas)
        .args(["-arch=sm_90", "-v", "-o"])
        .arg(&cubin)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", ptxas.display()));
    let said = format!("{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "ptxas refused {module}:\n{said}");
    // Every entry was compiled, and none spills (a spill in a bandwidth kernel costs HBM traffic).
    let text = std::fs::read_to_string(&src).expect("kernels");
    let entries: Vec<&str> =
        text.lines().filter_map(|l| l.strip_prefix(".visible .entry ")).map(|l| l.trim_end_matches('(')).collect();
    assert!(!entries.is_empty() && (module != KERNELS || entries.len() >= 5), "entries: {entries:?}");
    for e in &entries {
        assert!(said.contains(&format!("Compiling entry function '{e}' for 'sm_90'")), "{e} not compiled:\n{said}");
    }
    assert!(
        !said.contains("bytes spill stores")
            || said.matches(" 0 bytes spill stores").count() == said.matches("bytes spill stores").count(),
        "a kernel spills:\n{said}"
    );
}

/// The disassembly of `ptx` (PTX text) as ptxas builds it for Hopper, or None where the tools
/// are missing (the caller skips).
fn sass(ptx: &str) -> Option<String> {
    let (ptxas, nvdisasm) = (ptxas()?, nvdisasm()?);
    let dir = tempfile::tempdir().expect("tempdir");
    let (src, cubin) = (dir.path().join("k.ptx"), dir.path().join("k.cubin"));
    std::fs::write(&src, ptx).expect("write the PTX");
    let run = Command::new(&ptxas).args(["-arch=sm_90", "-o"]).arg(&cubin).arg(&src).output().unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let dis = Command::new(&nvdisasm).arg(&cubin).output().unwrap_or_else(|e| panic!("{}: {e}", nvdisasm.display()));
    assert!(dis.status.success(), "{}", String::from_utf8_lossy(&dis.stderr));
    Some(String::from_utf8_lossy(&dis.stdout).into_owned())
}

/// Whether `entry`'s machine code loads from global memory inside a loop: some backward branch
/// (`BRA` to a label above it) encloses an `LDG`. A load ptxas hoisted out of the loop or
/// deleted as dead is not inside one.
fn loads_inside_a_loop(sass: &str, entry: &str) -> bool {
    let head = format!(".text.{entry}:");
    let body = sass.split(&head).nth(1).unwrap_or_else(|| panic!("no {head} in the disassembly"));
    let lines: Vec<&str> = body.split("\n.text.").next().unwrap_or(body).lines().collect();
    let label_at = |name: &str| lines.iter().position(|l| l.trim() == format!("{name}:"));
    lines.iter().enumerate().any(|(at, line)| {
        let target = line.split("BRA `(").nth(1).and_then(|t| t.split(')').next());
        match target.and_then(label_at) {
            Some(top) if top < at => lines[top..at].iter().any(|l| l.contains("LDG")),
            _ => false,
        }
    })
}

/// The loads the probes' figures stand on are in the loops ptxas makes of them: the spin gate
/// re-reads its flag every turn (else on a GPU the gate never opens, and every sample waits out
/// its timeout), the chase's dependent loads are all there (else the latency is of nothing),
/// and the memory test's check reads memory in its loop. The fake's interpreter cannot see this
/// (it re-reads memory on every load); the machine code can. Each rule is shown to have teeth
/// on a one-line mutant that ptxas accepts: the spin's load without `.volatile` (hoisted out of
/// the loop) and the chase without its final store (every load dead, deleted).
#[test]
fn the_loads_the_figures_stand_on_stay_inside_their_loops() {
    let shipped = std::fs::read_to_string(common::repo().join(KERNELS)).expect("kernels");
    let Some(code) = sass(&shipped) else {
        common::skip(
            "needs ptxas and nvdisasm (scripts/test fetches them from NVIDIA's wheels; or set PHQ_PTXAS, PHQ_NVDISASM)",
        );
        return;
    };
    for entry in ["phq_spin", "phq_chase", "phq_mem_check"] {
        assert!(loads_inside_a_loop(&code, entry), "{entry}: no global load inside a loop in its machine code");
    }
    let mutant = |from: &str, to: &str| {
        assert_eq!(shipped.matches(from).count(), 1, "the mutation's line {from:?} is not in the kernels once");
        sass(&shipped.replacen(from, to, 1)).expect("the tools were there a moment ago")
    };
    let hoisted = mutant("ld.volatile.global.u32 %r1, [%rd1];", "ld.global.u32 %r1, [%rd1];");
    assert!(!loads_inside_a_loop(&hoisted, "phq_spin"), "a non-volatile spin load was not seen hoisted");
    let dead = mutant("st.global.u64 [%rd3], %rd1;", "");
    assert!(!loads_inside_a_loop(&dead, "phq_chase"), "a chase whose loads are dead was not seen");
}
