//! The PTX that ships, executed: every kernel of `src/probe/kernels.ptx` run by the interpreter
//! and by its Rust model on the same randomised small inputs — sizes that are not multiples of
//! the block or the grid, a grid smaller than the work, both walking directions, every pattern
//! mode, next-pattern writes, GEMM sizes 16/32/48 with integer inputs, planted stuck and coupled
//! bits — and compared byte for byte, with the mismatch counts and the set of kept records. A
//! model that differs from the PTX is wrong; so is a one-line change to the PTX that the model
//! does not make.

use super::*;
use crate::scenario::Path;

const PTX: &str = include_str!("../../../src/probe/kernels.ptx");
const TENSOR: &str = include_str!("../../../src/probe/tensor.ptx");

/// xorshift64: a reproducible stream of test inputs.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[derive(Clone, Copy)]
enum A {
    U64(u64),
    U32(u32),
}

/// One GPU (and a peer) of a scenario, a context on it, the agent's module loaded.
struct Rig {
    w: World,
    ctx: usize,
    peer_ctx: usize,
    stream: usize,
    module: Arc<ptx::Module>,
}

fn scenario(extra: &str) -> Scenario {
    let text = format!(
        r#"{{"devices": [
          {{"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0", "memory_bytes": 1073741824,
            "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 3000 {extra}}},
          {{"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:2a:00.0", "memory_bytes": 1073741824,
            "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 3000}}]}}"#
    );
    serde_json::from_str(&text).unwrap()
}

impl Rig {
    fn new(path: Path, extra: &str) -> Rig {
        let mut s = scenario(extra);
        s.kernels = path;
        let mut w = World::new(s).unwrap();
        let ctx_on = |w: &mut World, d: usize| {
            let (h, st) = (w.handle(), w.handle());
            w.contexts.insert(h, Ctx { device: d, refs: 1, peers: Vec::new(), default_stream: st });
            w.streams.insert(st, Stream { ctx: h, clock: 0.0 });
            (h, st)
        };
        let (ctx, stream) = ctx_on(&mut w, 0);
        let (peer_ctx, _) = ctx_on(&mut w, 1);
        let module = Arc::new(ptx::parse(PTX).unwrap());
        Rig { w, ctx, peer_ctx, stream, module }
    }

    fn alloc(&mut self, bytes: usize) -> u64 {
        self.w.alloc(self.ctx, bytes, false).unwrap()
    }

    fn alloc_peer(&mut self, bytes: usize) -> u64 {
        self.w.alloc(self.peer_ctx, bytes, false).unwrap()
    }

    fn write(&mut self, ptr: u64, bytes: &[u8]) {
        self.w.write(ptr, bytes).unwrap();
    }

    fn read(&mut self, ptr: u64, len: usize) -> Vec<u8> {
        self.w.read(ptr, len).unwrap()
    }

    fn launch(&mut self, name: &str, args: &[A], grid: u32, block: u32) -> CUresult {
        let mut vals: Vec<[u8; 8]> = args
            .iter()
            .map(|a| match a {
                A::U64(v) => v.to_le_bytes(),
                A::U32(v) => {
                    let mut b = [0u8; 8];
                    b[..4].copy_from_slice(&v.to_le_bytes());
                    b
                }
            })
            .collect();
        let mut ptrs: Vec<*mut c_void> = vals.iter_mut().map(|v| v.as_mut_ptr() as *mut c_void).collect();
        let module = self.module.clone();
        // SAFETY: one pointer per parameter, each to 8 bytes holding the value.
        let r = unsafe {
            kernels::launch(
                &mut self.w,
                &module,
                name,
                self.ctx,
                self.stream,
                ptrs.as_mut_ptr(),
                [grid, 1, 1],
                [block, 1, 1],
            )
        };
        kernels::settle_gates(&mut self.w);
        r
    }

    fn poisoned(&self) -> Option<CUresult> {
        self.w.poisoned[0]
    }
}

/// Both rigs, run alike.
struct Pair {
    ptx: Rig,
    model: Rig,
}

impl Pair {
    fn new(extra: &str) -> Pair {
        Pair { ptx: Rig::new(Path::Interpret, extra), model: Rig::new(Path::Model, extra) }
    }
    fn alloc(&mut self, bytes: usize) -> u64 {
        let a = self.ptx.alloc(bytes);
        assert_eq!(a, self.model.alloc(bytes));
        a
    }
    fn write(&mut self, ptr: u64, bytes: &[u8]) {
        self.ptx.write(ptr, bytes);
        self.model.write(ptr, bytes);
    }
    fn launch(&mut self, what: &str, name: &str, args: &[A], grid: u32, block: u32) {
        let (p, m) = (self.ptx.launch(name, args, grid, block), self.model.launch(name, args, grid, block));
        assert_eq!(p, SUCCESS, "{what}: the PTX launch");
        assert_eq!(m, SUCCESS, "{what}: the model's launch");
        assert_eq!(self.ptx.poisoned(), None, "{what}: the PTX faulted: {:?}", self.ptx.w.kernel_faults);
        assert_eq!(self.model.poisoned(), None, "{what}: the model faulted");
    }
    /// The same bytes in both, or the first difference.
    fn same(&mut self, what: &str, ptr: u64, len: usize) {
        let (a, b) = (self.ptx.read(ptr, len), self.model.read(ptr, len));
        if let Some(i) = (0..len).find(|i| a[*i] != b[*i]) {
            let w = i / 8 * 8;
            let word = |v: &[u8]| u64::from_le_bytes(v[w..w + 8].try_into().unwrap_or([0; 8]));
            panic!(
                "{what}: the model differs from the PTX at byte {i} of {len} (word {:#x}: PTX {:#018x}, model {:#018x})",
                ptr + w as u64,
                word(&a),
                word(&b)
            );
        }
    }
    /// The check kernels' result: the same count, and the same kept records as a set (which of
    /// the mismatches got the first tickets is the GPU's order, not the kernel's contract).
    fn same_result(&mut self, what: &str, result: u64) -> u64 {
        let read = |r: &mut Rig| {
            let b = r.read(result, 200);
            let count = u64::from_le_bytes(b[..8].try_into().unwrap());
            let mut recs: Vec<[u64; 3]> = (0..count.min(8) as usize)
                .map(|s| {
                    let at = 8 + 24 * s;
                    let v = |k: usize| u64::from_le_bytes(b[at + 8 * k..at + 8 * k + 8].try_into().unwrap());
                    [v(0), v(1), v(2)]
                })
                .collect();
            recs.sort_unstable();
            (count, recs)
        };
        let (p, m) = (read(&mut self.ptx), read(&mut self.model));
        assert_eq!(p.0, m.0, "{what}: mismatch counts: PTX {}, model {}", p.0, m.0);
        if p.0 <= 8 {
            assert_eq!(p.1, m.1, "{what}: kept records");
        }
        p.0
    }
}

fn shape(rng: &mut Rng) -> (u32, u32) {
    let grid = 1 + rng.below(5) as u32;
    let block = [32, 64, 96, 128, 256][rng.below(5) as usize];
    (grid, block)
}

#[test]
fn mem_write_and_check_match_the_ptx() {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let modes = [0u32, 1, 2, 3, 9];
    for case in 0..24 {
        // Planted faults on some cases: a stuck bit and couplings whose aggressor lies in an
        // earlier iteration, the same one, or a later one.
        let planted = case % 3 == 0;
        let planted = if planted {
            r#", "stuck_bits": [{"offset": 4104, "bit": 3, "value": 1}, {"offset": 40, "bit": 7, "value": 0}],
                 "coupled_bits": [{"offset": 2051, "bit": 5, "aggressor": 8195}, {"offset": 16390, "bit": 1, "aggressor": 1030},
                                  {"offset": 3000, "bit": 2, "aggressor": 3012}]"#
        } else {
            ""
        };
        // The cells alone, no L2 in front of them: the L2 has its own test below.
        let mut p = Pair::new(&format!(r#", "l2_bytes": 0{planted}"#));
        let words = 200 + rng.below(2800);
        let skip = rng.below(4) * 8;
        let base = p.alloc((words * 8 + skip) as usize);
        let result = p.alloc(200);
        let ptr = base + skip;
        let (grid, block) = shape(&mut rng);
        let (mode, arg) = (modes[rng.below(5) as usize], rng.next());
        let what = format!("case {case}: {words} words at +{skip}, mode {mode}, grid {grid} × {block}");
        p.launch(&what, "phq_mem_write", &[A::U64(ptr), A::U64(words), A::U32(mode), A::U64(arg)], grid, block);
        p.same(&what, base, (words * 8 + skip) as usize);
        // A few words corrupted by hand, on some cases.
        if case % 4 == 1 {
            for _ in 0..1 + rng.below(12) {
                let at = ptr + 8 * rng.below(words);
                p.write(at, &rng.next().to_le_bytes());
            }
        }
        for pass in 0..3 {
            p.write(result, &[0u8; 200]);
            let (check_mode, check_arg) =
                if rng.below(4) == 0 { (modes[rng.below(5) as usize], rng.next()) } else { (mode, arg) };
            let next = if rng.below(2) == 0 { (u32::MAX, 0) } else { (modes[rng.below(5) as usize], rng.next()) };
            let descending = rng.below(2) as u32;
            let (grid, block) = shape(&mut rng);
            let what = format!(
                "{what}; check {pass}: mode {check_mode}, next {}, descending {descending}, grid {grid} × {block}",
                next.0 as i64
            );
            p.launch(
                &what,
                "phq_mem_check",
                &[
                    A::U64(ptr),
                    A::U64(words),
                    A::U32(check_mode),
                    A::U64(check_arg),
                    A::U32(next.0),
                    A::U64(next.1),
                    A::U32(descending),
                    A::U64(result),
                ],
                grid,
                block,
            );
            p.same(&what, base, (words * 8 + skip) as usize);
            p.same_result(&what, result);
        }
    }
}

/// The planted faults are found by the PTX itself: a stuck bit under a pattern that gives it
/// the other value, and a coupling under address patterns.
#[test]
fn the_ptx_finds_planted_faults() {
    let extra = r#", "l2_bytes": 0, "stuck_bits": [{"offset": 64, "bit": 0, "value": 1}],
                     "coupled_bits": [{"offset": 1024, "bit": 4, "aggressor": 2048}]"#;
    let mut r = Rig::new(Path::Interpret, extra);
    let buf = r.alloc(4096);
    let result = r.alloc(200);
    r.launch("phq_mem_write", &[A::U64(buf), A::U64(512), A::U32(0), A::U64(0)], 2, 64);
    r.write(result, &[0u8; 200]);
    r.launch(
        "phq_mem_check",
        &[A::U64(buf), A::U64(512), A::U32(0), A::U64(0), A::U32(u32::MAX), A::U64(0), A::U32(0), A::U64(result)],
        2,
        64,
    );
    let b = r.read(result, 200);
    assert_eq!(u64::from_le_bytes(b[..8].try_into().unwrap()), 1, "solid zeros: the stuck-at-1 bit, not the coupling");
    assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), buf + 64);
    r.launch("phq_mem_write", &[A::U64(buf), A::U64(512), A::U32(1), A::U64(0)], 2, 64);
    r.write(result, &[0u8; 200]);
    r.launch(
        "phq_mem_check",
        &[A::U64(buf), A::U64(512), A::U32(1), A::U64(0), A::U32(u32::MAX), A::U64(0), A::U32(1), A::U64(result)],
        2,
        64,
    );
    let b = r.read(result, 200);
    let count = u64::from_le_bytes(b[..8].try_into().unwrap());
    assert!(count >= 1, "address in address sees the coupled bit");
}

/// A stuck bit among the last bytes written is not seen by a check that reads them while they
/// are dirty in the L2 (what the GPU reads is what was written), and is seen once twice the
/// L2's size has been written elsewhere — on both paths, the PTX's and the model's.
#[test]
fn the_l2_hides_the_last_writes_until_they_are_evicted() {
    let extra = r#", "l2_bytes": 65536, "stuck_bits": [{"offset": 4096, "bit": 0, "value": 1}]"#;
    for path in [Path::Interpret, Path::Model] {
        let mut r = Rig::new(path, extra);
        let buf = r.alloc(16384);
        let result = r.alloc(200);
        let evict = r.alloc(131072);
        let check = |r: &mut Rig| {
            r.write(result, &[0u8; 200]);
            r.launch(
                "phq_mem_check",
                &[
                    A::U64(buf),
                    A::U64(2048),
                    A::U32(0),
                    A::U64(0),
                    A::U32(u32::MAX),
                    A::U64(0),
                    A::U32(0),
                    A::U64(result),
                ],
                2,
                64,
            );
            let b = r.read(result, 200);
            (u64::from_le_bytes(b[..8].try_into().unwrap()), u64::from_le_bytes(b[8..16].try_into().unwrap()))
        };
        r.launch("phq_mem_write", &[A::U64(buf), A::U64(2048), A::U32(0), A::U64(0)], 2, 64);
        assert_eq!(check(&mut r).0, 0, "{path:?}: the zeros just written are read from the L2");
        r.launch("phq_mem_write", &[A::U64(evict), A::U64(16384), A::U32(0), A::U64(7)], 4, 128);
        assert_eq!(check(&mut r), (1, buf + 4096), "{path:?}: after the eviction the stuck bit shows");
    }
}

/// The tensor-core GEMM (`tensor.ptx`): `mma.sync` run by the interpreter with the ISA's
/// fragment layouts, against the model and against the exact product, for n = 16, 32 and 48
/// with integer BF16 and FP16 inputs from −8 to 8 (exact in both, sums exact in FP32); blocks of four
/// warps as the kernel counts them, of eight (two blocks then share tiles), and a grid too
/// small for the tiles (the rest of C is left as it was).
#[test]
fn the_tensor_gemm_matches_the_ptx_and_the_exact_product() {
    let mut rng = Rng(0x5eed_7e45);
    for (case, n, f16) in [16usize, 32, 48, 48, 32].into_iter().enumerate().flat_map(|(c, n)| [(c, n, 0), (c, n, 1)]) {
        // The last case: a faulty GPU, one entry of every product 1.0 too large, on both paths.
        let mut p = Pair::new(if case == 4 { r#", "gemm_wrong_entries": [[3, 5]]"# } else { "" });
        for r in [&mut p.ptx, &mut p.model] {
            r.module = Arc::new(ptx::parse(TENSOR).unwrap());
        }
        let (a, b, c) = (p.alloc(n * n * 2), p.alloc(n * n * 2), p.alloc(n * n * 4));
        // A row-major, B column-major: element (i, k) of A at i·n + k, (k, j) of B at j·n + k.
        let ints = |rng: &mut Rng| -> Vec<i64> { (0..n * n).map(|_| rng.below(17) as i64 - 8).collect() };
        let (ia, ib) = (ints(&mut rng), ints(&mut rng));
        // BF16: FP32's top half. FP16: sign, exponent rebiased from 127 to 15, the mantissa's top
        // ten bits (exact for these integers).
        let half = |x: i64| -> u16 {
            let bits = (x as f32).to_bits();
            match (f16, x) {
                (0, _) => (bits >> 16) as u16,
                (_, 0) => 0,
                _ => {
                    ((bits >> 16) & 0x8000 | ((((bits >> 23) & 0xff) - 127 + 15) << 10) | ((bits >> 13) & 0x3ff)) as u16
                }
            }
        };
        let encode = |v: &[i64]| -> Vec<u8> { v.iter().flat_map(|x| half(*x).to_le_bytes()).collect() };
        p.write(a, &encode(&ia));
        p.write(b, &encode(&ib));
        p.write(c, &vec![0xAB; n * n * 4]);
        let tiles = (n * n / 128) as u32;
        let (grid, block) = match case {
            2 => (tiles.div_ceil(4), 256),
            3 => (2, 128),
            _ => (tiles.div_ceil(4), 128),
        };
        let what = format!("mma gemm n = {n}, {}, grid {grid} × {block}", ["BF16", "FP16"][f16 as usize]);
        let args = [A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32), A::U32(f16)];
        p.launch(&what, "phq_mma_gemm", &args, grid, block);
        p.same(&what, c, n * n * 4);
        let got = p.ptx.read(c, n * n * 4);
        let rows = n / 16;
        for j in 0..n {
            for i in 0..n {
                let tile = (j / 8) * rows + i / 16;
                let cell = u32::from_le_bytes(got[4 * (j * n + i)..4 * (j * n + i) + 4].try_into().unwrap());
                if tile < 4 * grid as usize || block == 256 {
                    let want: i64 = (0..n).map(|k| ia[i * n + k] * ib[j * n + k]).sum::<i64>()
                        + i64::from(case == 4 && (i, j) == (3, 5));
                    assert_eq!(f32::from_bits(cell), want as f32, "{what}: C({i},{j})");
                } else {
                    assert_eq!(cell, 0xABAB_ABAB, "{what}: C({i},{j}) has no warp and stays");
                }
            }
        }
    }
}

#[test]
fn copy_chase_and_spin_match_the_ptx() {
    let mut rng = Rng(42);
    for case in 0..8 {
        let mut p = Pair::new("");
        let count = 1 + rng.below(3000);
        let (src, dst) = (p.alloc((count * 16) as usize), p.alloc((count * 16) as usize));
        let data: Vec<u8> = (0..count * 16).map(|_| rng.next() as u8).collect();
        p.write(src, &data);
        let (grid, block) = shape(&mut rng);
        let what = format!("copy case {case}: {count} vectors, grid {grid} × {block}");
        p.launch(&what, "phq_copy_sm", &[A::U64(dst), A::U64(src), A::U64(count)], grid, block);
        p.same(&what, dst, (count * 16) as usize);

        // A pointer chain through this GPU's memory and a peer's (access enabled).
        let nodes = 2 + rng.below(60);
        let local = p.alloc((nodes * 8) as usize);
        let peer = p.ptx.alloc_peer((nodes * 8) as usize);
        assert_eq!(peer, p.model.alloc_peer((nodes * 8) as usize));
        for r in [&mut p.ptx, &mut p.model] {
            let c = r.ctx;
            r.w.contexts.get_mut(&c).unwrap().peers.push(1);
        }
        let out = p.alloc(8);
        let mut order: Vec<u64> = (0..2 * nodes).collect();
        for i in (1..order.len()).rev() {
            order.swap(i, rng.below(i as u64 + 1) as usize);
        }
        let addr = |k: u64| if k < nodes { local + 8 * k } else { peer + 8 * (k - nodes) };
        for (i, k) in order.iter().enumerate() {
            let next = addr(order[(i + 1) % order.len()]);
            p.write(addr(*k), &next.to_le_bytes());
        }
        let steps = rng.below(300);
        let what = format!("chase case {case}: {steps} steps over {} nodes", 2 * nodes);
        p.launch(&what, "phq_chase", &[A::U64(addr(order[0])), A::U64(steps), A::U64(out)], 1, 1);
        p.same(&what, out, 8);
        let clock = |r: &Rig| r.w.streams[&r.stream].clock;
        assert!((clock(&p.ptx) - clock(&p.model)).abs() < 1e-12, "{what}: the chase's time differs");
    }
    // The spin kernel: a flag already set lets it go; a flag never set times out, status 1.
    for set in [1u32, 0] {
        let mut host = vec![0u32; 2];
        host[0] = set;
        let mut results = Vec::new();
        for path in [Path::Interpret, Path::Model] {
            let mut r = Rig::new(path, "");
            let mut words = host.clone();
            let layout = std::alloc::Layout::from_size_align(8, 8).unwrap();
            r.w.pinned.insert(words.as_mut_ptr() as usize, (8, layout));
            let flag = words.as_mut_ptr() as u64;
            assert_eq!(r.launch("phq_spin", &[A::U64(flag), A::U64(5_000), A::U64(flag + 4)], 1, 1), SUCCESS);
            r.w.pinned.clear();
            results.push(words[1]);
        }
        assert_eq!(results[0], results[1], "flag {set}: status");
        assert_eq!(results[0], u32::from(set == 0));
    }
}

#[test]
fn sgemm_and_gemm_check_match_the_ptx() {
    let mut rng = Rng(7);
    for (case, n) in [16usize, 32, 48, 32].into_iter().enumerate() {
        // The last case: a GPU whose GEMM gets two entries wrong.
        let extra = if case == 3 { r#", "gemm_wrong_entries": [[3, 5], [30, 0]]"# } else { "" };
        let mut p = Pair::new(extra);
        let bytes = n * n * 4;
        let (a, b, c) = (p.alloc(bytes), p.alloc(bytes), p.alloc(bytes));
        let mat =
            |rng: &mut Rng| -> Vec<u8> { (0..n * n).flat_map(|_| (rng.below(9) as f32 - 4.0).to_le_bytes()).collect() };
        let (ma, mb) = (mat(&mut rng), mat(&mut rng));
        p.write(a, &ma);
        p.write(b, &mb);
        let tiles = (n / 16) as u32;
        let what = format!("sgemm n = {n}");
        p.launch(&what, "phq_sgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], tiles * tiles, 256);
        p.same(&what, c, bytes);
        // Exact: integer inputs, FP32 sums.
        let got = p.ptx.read(c, bytes);
        let f = |v: &[u8], k: usize| f32::from_le_bytes(v[4 * k..4 * k + 4].try_into().unwrap());
        let wrong = if case == 3 { vec![(3, 5), (30, 0)] } else { vec![] };
        for j in 0..n {
            for i in 0..n {
                let want: f32 = (0..n).map(|k| f(&ma, i + k * n) * f(&mb, k + j * n)).sum::<f32>()
                    + if wrong.contains(&(i, j)) { 1.0 } else { 0.0 };
                assert_eq!(f(&got, i + j * n), want, "{what}: C({i},{j})");
            }
        }
        // The check kernel against a table, with a few entries of C changed.
        let table = p.alloc(17 * 17 * 4);
        let t: Vec<u8> = (0..17 * 17).flat_map(|_| (rng.below(9) as f32).to_le_bytes()).collect();
        p.write(table, &t);
        for _ in 0..rng.below(5) {
            let e = rng.below((n * n) as u64);
            p.write(c + 4 * e, &(rng.below(9) as f32).to_le_bytes());
        }
        let result = p.alloc(200);
        p.write(result, &[0u8; 200]);
        let (grid, block) = shape(&mut rng);
        let what = format!("gemm_check n = {n}, grid {grid} × {block}");
        p.launch(&what, "phq_gemm_check", &[A::U64(c), A::U32(n as u32), A::U64(table), A::U64(result)], grid, block);
        p.same_result(&what, result);

        // And against a C that is the table's own product but for three planted entries: few
        // enough that every mismatch is kept, so the records themselves are compared, each
        // (index, the word read, the word expected) exactly, on both paths.
        let t_at = |i: usize, j: usize| &t[4 * ((i % 17) * 17 + j % 17)..][..4];
        let mut right: Vec<u8> = (0..n * n).flat_map(|e| t_at(e % n, e / n).to_vec()).collect();
        let planted: Vec<usize> = [3, n * n / 2 + 1, n * n - 1].to_vec();
        let mut want = Vec::new();
        for (k, e) in planted.iter().enumerate() {
            let bits = (100.0 + k as f32).to_le_bytes();
            right[4 * e..4 * e + 4].copy_from_slice(&bits);
            let expected = u32::from_le_bytes(t_at(e % n, e / n).try_into().unwrap());
            want.push([*e as u64, u64::from(u32::from_le_bytes(bits)), u64::from(expected)]);
        }
        p.write(c, &right);
        p.write(result, &[0u8; 200]);
        let what = format!("gemm_check n = {n} with 3 planted entries, grid {grid} × {block}");
        p.launch(&what, "phq_gemm_check", &[A::U64(c), A::U32(n as u32), A::U64(table), A::U64(result)], grid, block);
        assert_eq!(p.same_result(&what, result), 3, "{what}");
        let b = p.ptx.read(result, 200);
        let mut got: Vec<[u64; 3]> = (0..3)
            .map(|r| std::array::from_fn(|k| u64::from_le_bytes(b[8 + 24 * r + 8 * k..][..8].try_into().unwrap())))
            .collect();
        got.sort_unstable();
        assert_eq!(got, want, "{what}: the records are (index, read, expected)");
    }
}

/// `phq_dgemm` run on its inputs through `module`: C's bytes (n×n FP64), or None when the launch
/// faulted.
fn dgemm_on(module: &Arc<ptx::Module>, n: usize, ma: &[u8], mb: &[u8]) -> Option<Vec<u8>> {
    let mut r = Rig::new(Path::Interpret, "");
    r.module = module.clone();
    let bytes = n * n * 8;
    let (a, b, c) = (r.alloc(bytes), r.alloc(bytes), r.alloc(bytes));
    r.write(a, ma);
    r.write(b, mb);
    let tiles = (n / 16) as u32;
    let ok = r.launch("phq_dgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], tiles * tiles, 256);
    (ok == SUCCESS && r.poisoned().is_none()).then(|| r.read(c, bytes))
}

/// Random FP64 matrices of n×n entries: integers from −4 to 4 (`fractions` false: every sum
/// exact) or values in [−1, 1) with all 53 bits of mantissa (every product and sum rounds, so
/// the order and the fused multiply-add's single rounding matter).
fn f64_matrix(rng: &mut Rng, n: usize, fractions: bool) -> Vec<u8> {
    (0..n * n)
        .flat_map(|_| {
            let v = if fractions {
                (rng.next() >> 11) as f64 / (1u64 << 52) as f64 - 1.0
            } else {
                rng.below(9) as f64 - 4.0
            };
            v.to_le_bytes()
        })
        .collect()
}

/// `phq_dgemm`, the FP64 GEMM: the model equals the PTX to the bit on integer and on rounding
/// inputs (both sum in k order with `fma.rn.f64`), the integer product is exact, and a faulty
/// GPU's wrong entries come out wrong on both paths.
#[test]
fn dgemm_matches_the_ptx() {
    let mut rng = Rng(11);
    let f = |v: &[u8], k: usize| f64::from_le_bytes(v[8 * k..8 * k + 8].try_into().unwrap());
    for (case, (n, fractions)) in [(16usize, false), (32, true), (48, false), (32, false)].into_iter().enumerate() {
        let extra = if case == 3 { r#", "gemm_wrong_entries": [[3, 5], [30, 0]]"# } else { "" };
        let mut p = Pair::new(extra);
        let bytes = n * n * 8;
        let (a, b, c) = (p.alloc(bytes), p.alloc(bytes), p.alloc(bytes));
        let (ma, mb) = (f64_matrix(&mut rng, n, fractions), f64_matrix(&mut rng, n, fractions));
        p.write(a, &ma);
        p.write(b, &mb);
        let tiles = (n / 16) as u32;
        let what = format!("dgemm n = {n}, fractions {fractions}");
        p.launch(&what, "phq_dgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], tiles * tiles, 256);
        p.same(&what, c, bytes);
        let got = p.ptx.read(c, bytes);
        let wrong = if case == 3 { vec![(3, 5), (30, 0)] } else { vec![] };
        for j in 0..n {
            for i in 0..n {
                let sum = (0..n).fold(0.0f64, |acc, k| f(&ma, i + k * n).mul_add(f(&mb, k + j * n), acc));
                let want = sum + if wrong.contains(&(i, j)) { 1.0 } else { 0.0 };
                assert_eq!(f(&got, i + j * n), want, "{what}: C({i},{j})");
            }
        }
    }
}

/// One-line changes to `phq_dgemm`, each accepted by `ptxas -arch=sm_90` (checked when they were
/// written down), each caught by the exact product on rounding inputs: the interpreter runs the
/// shipped text, so a kernel that is wrong on a GPU is wrong here.
#[test]
fn one_line_mutants_of_the_fp64_gemm_are_caught() {
    let shipped = PTX.find(".visible .entry phq_dgemm(").unwrap();
    let end = shipped + PTX[shipped..].find("\n}\n").unwrap();
    let mutants = [
        // FP32 element size in the load of A.
        ("    shl.b64 %rd4, %rd4, 3;", "    shl.b64 %rd4, %rd4, 2;"),
        // B's tile slot from the wrong index.
        ("    add.u32 %r17, %r16, %r3;", "    add.u32 %r17, %r16, %r4;"),
        // The sum rounded twice: a multiply, then an add.
        (
            "    fma.rn.f64 %fd1, %fd2, %fd3, %fd1;",
            "    mul.rn.f64 %fd2, %fd2, %fd3;\n    add.rn.f64 %fd1, %fd1, %fd2;",
        ),
        // A's tile walked along the wrong axis.
        ("    add.u32 %r18, %r18, 128;", "    add.u32 %r18, %r18, 8;"),
        // One step of k too few inside a tile.
        ("    setp.lt.u32 %p2, %r20, 16;", "    setp.lt.u32 %p2, %r20, 15;"),
        // The accumulator not cleared (a register never written).
        ("    mov.f64 %fd1, 0d0000000000000000;", ""),
        // C stored transposed.
        (
            "    mul.wide.u32 %rd8, %r10, %r1;\n    cvt.u64.u32 %rd9, %r9;",
            "    mul.wide.u32 %rd8, %r9, %r1;\n    cvt.u64.u32 %rd9, %r10;",
        ),
    ];
    let mut rng = Rng(12);
    let n = 32;
    let (ma, mb) = (f64_matrix(&mut rng, n, true), f64_matrix(&mut rng, n, true));
    let module = Arc::new(ptx::parse(PTX).unwrap());
    let right = dgemm_on(&module, n, &ma, &mb).expect("the shipped kernel runs");
    for (from, to) in mutants {
        let body = &PTX[shipped..end];
        assert_eq!(body.matches(from).count(), 1, "the mutant's line {from:?} is not in phq_dgemm once");
        let text = format!("{}{}{}", &PTX[..shipped], body.replacen(from, to, 1), &PTX[end..]);
        let Ok(m) = ptx::parse(&text) else { continue };
        let got = dgemm_on(&Arc::new(m), n, &ma, &mb);
        assert_ne!(got.as_ref(), Some(&right), "the mutant {from:?} → {to:?} computes the right product");
    }
}

/// The sanitizer's checks, each catching a planted fault through the agent's own kernels.
#[test]
fn the_memcheck_catches_what_a_gpu_would_not_say() {
    // Outside every allocation: CUDA_ERROR_ILLEGAL_ADDRESS, sticky, naming kernel and thread.
    let mut r = Rig::new(Path::Interpret, "");
    let buf = r.alloc(4096);
    assert_eq!(r.launch("phq_mem_write", &[A::U64(buf), A::U64(4096 / 8 + 1), A::U32(0), A::U64(0)], 1, 64), SUCCESS);
    assert_eq!(r.poisoned(), Some(ILLEGAL_ADDRESS));
    let f = &r.w.kernel_faults[0];
    assert!(f.to_string().starts_with("phq_mem_write: block (0,0,0) thread (0,0,0), line"), "{f}");
    assert!(f.message.contains("no allocation holds it") && f.instr.starts_with("st.global.u64"), "{f}");

    // Freed memory.
    let mut r = Rig::new(Path::Interpret, "");
    let buf = r.alloc(4096);
    assert_eq!(r.w.free(buf), SUCCESS);
    r.launch("phq_mem_write", &[A::U64(buf), A::U64(8), A::U32(0), A::U64(0)], 1, 32);
    assert_eq!(r.poisoned(), Some(ILLEGAL_ADDRESS));
    assert!(r.w.kernel_faults[0].message.contains("use after free"), "{}", r.w.kernel_faults[0]);

    // Another GPU's memory without peer access.
    let mut r = Rig::new(Path::Interpret, "");
    let theirs = r.alloc_peer(4096);
    r.launch("phq_mem_write", &[A::U64(theirs), A::U64(8), A::U32(0), A::U64(0)], 1, 32);
    assert_eq!(r.poisoned(), Some(ILLEGAL_ADDRESS));
    assert!(r.w.kernel_faults[0].message.contains("no peer access"), "{}", r.w.kernel_faults[0]);

    // Misaligned: a copy kernel's 16-byte vectors 8 bytes off.
    let mut r = Rig::new(Path::Interpret, "");
    let (src, dst) = (r.alloc(4096), r.alloc(4096));
    r.launch("phq_copy_sm", &[A::U64(dst), A::U64(src + 8), A::U64(4)], 1, 32);
    assert_eq!(r.poisoned(), Some(716));
    assert!(r.w.kernel_faults[0].instr.starts_with("ld.global.cs.v4.u32"), "{}", r.w.kernel_faults[0]);

    // A register never written, a shared race and a barrier that hangs: kernels with one
    // defect planted each.
    let broken = |from: &str, to: &str| -> Arc<ptx::Module> {
        assert!(PTX.contains(from), "{from}");
        Arc::new(ptx::parse(&PTX.replacen(from, to, 1)).unwrap())
    };
    let cases = [
        ("mov.u32 %r5, %nctaid.x;\n    mul.wide.u32 %rd4, %r2, %r3;\n    cvt.u64.u32 %rd5, %r4;\n    add.u64 %rd4, %rd4, %rd5;          // i = block", "mul.wide.u32 %rd4, %r2, %r3;\n    cvt.u64.u32 %rd5, %r4;\n    add.u64 %rd4, %rd4, %rd5;          // i = block", "phq_mem_write", "reads %r5, which was never written"),
        ("    bar.sync 0;\n    // acc +=", "    // acc +=", "phq_sgemm", "read-after-write"),
        ("    bar.sync 0;\n    add.u32 %r16, %r16, 16;", "    add.u32 %r16, %r16, 16;", "phq_sgemm", "write-after-read"),
        ("    setp.ge.u32 %p1, %r16, %r1;\n    @%p1 bra SGEMM_STORE;", "    setp.ge.u32 %p1, %r16, %r1;\n    @%p1 bra SGEMM_STORE;\n    setp.eq.u32 %p2, %r2, 5;\n    @%p2 bra SGEMM_STORE;", "phq_sgemm", "which has exited"),
    ];
    for (from, to, kernel, says) in cases {
        let mut r = Rig::new(Path::Interpret, "");
        r.module = broken(from, to);
        let n = 32u32;
        let (a, b, c) = (r.alloc(4096), r.alloc(4096), r.alloc(4096));
        let args = if kernel == "phq_sgemm" {
            vec![A::U64(a), A::U64(b), A::U64(c), A::U32(n)]
        } else {
            vec![A::U64(a), A::U64(16), A::U32(0), A::U64(0)]
        };
        let grid = if kernel == "phq_sgemm" { 4 } else { 1 };
        let block = if kernel == "phq_sgemm" { 256 } else { 32 };
        assert_eq!(r.launch(kernel, &args, grid, block), SUCCESS);
        let f = r.w.kernel_faults.first().unwrap_or_else(|| panic!("{kernel}: {says}: nothing caught"));
        assert!(f.message.contains(says), "{kernel}: expected {says:?}: {f}");
        assert!(r.poisoned().is_some());
    }
}

/// The launch contract of `phq_sgemm` (block 256, grid (n/16)², n % 16 = 0): a wrong shape
/// computes the wrong product or none, which the interpreter shows (the model ignores shapes).
#[test]
fn a_wrong_sgemm_launch_shape_is_visible() {
    let n = 32usize;
    let mut r = Rig::new(Path::Interpret, "");
    let (a, b, c) = (r.alloc(n * n * 4), r.alloc(n * n * 4), r.alloc(n * n * 4));
    let ones: Vec<u8> = (0..n * n).flat_map(|_| 1.0f32.to_le_bytes()).collect();
    r.write(a, &ones);
    r.write(b, &ones);
    r.write(c, &vec![0u8; n * n * 4]);
    // Half the blocks: half of C never computed.
    r.launch("phq_sgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], 2, 256);
    let got = r.read(c, n * n * 4);
    let zeros = got.chunks(4).filter(|v| f32::from_le_bytes((*v).try_into().unwrap()) == 0.0).count();
    assert_eq!(zeros, n * n / 2);
}
