//! Full-size launches of the PTX that ships, sampled. The probes launch their kernels with
//! grids and buffers far beyond what the interpreter can run whole (the `auto` path gives them
//! to the Rust models), so a kernel whose address arithmetic is right below 4 GiB and wrong
//! above it (a 32-bit product where a `mul.wide` belongs, a 32-bit add before widening) would
//! pass every small launch of `tests_ptx` and fail on an 80 GB GPU. Here each kernel runs with
//! the probes' own grid shape and arguments at a size whose byte offsets cross 2^32 (and 2^31,
//! where a signed 32-bit offset would turn negative), in an allocation of the 80 GB fixture
//! GPU, through the interpreter — but only a sample of its blocks (`interp::run_blocks`): the
//! first, the last, and those whose addresses straddle 2^31 and 2^32 bytes. The other blocks
//! never run, so what they would write stays as it was (each test checks one such place).
//! Memory is sparse (`Mem`): a sampled block costs the pages it writes.
//!
//! Each sampled block's results are checked against the kernel's definition: the words the
//! pattern puts at their addresses, the mismatches planted where the block reads, the
//! products of inputs planted above the crossing.

use super::*;

const PTX: &str = include_str!("../../../src/probe/kernels.ptx");
const TENSOR: &str = include_str!("../../../src/probe/tensor.ptx");

/// The probes' grid-stride launch: 8 blocks of 256 threads per SM (src/probe/kernels.rs,
/// `BLOCK`, `BLOCKS_PER_SM`) on the 132 SMs the fake reports (`cuDeviceGetAttribute`,
/// MULTIPROCESSOR_COUNT of an H100 SXM).
const BLOCK: u32 = 256;
const GRID: u32 = 132 * 8;
const THREADS: u64 = GRID as u64 * BLOCK as u64;
const GIB: u64 = 1 << 30;

#[derive(Clone, Copy)]
enum A {
    U64(u64),
    U32(u32),
}

/// The 80 GB fixture GPU, a context on it, the agent's modules parsed.
struct Big {
    w: World,
    ctx: usize,
    stream: usize,
    kernels: Arc<ptx::Module>,
    tensor: Arc<ptx::Module>,
}

impl Big {
    fn new() -> Big {
        let text = r#"{"devices": [{"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "0000:18:00.0",
            "memory_bytes": 85899345920, "h2d_gbps": 50, "d2h_gbps": 40, "hbm_gbps": 3000, "l2_bytes": 0}]}"#;
        let mut w = World::new(serde_json::from_str(text).unwrap()).unwrap();
        let (ctx, stream) = (w.handle(), w.handle());
        w.contexts.insert(ctx, Ctx { device: 0, refs: 1, peers: Vec::new(), default_stream: stream });
        w.streams.insert(stream, Stream { ctx, clock: 0.0 });
        let kernels = Arc::new(ptx::parse(PTX).unwrap());
        let tensor = Arc::new(ptx::parse(TENSOR).unwrap());
        Big { w, ctx, stream, kernels, tensor }
    }

    fn alloc(&mut self, bytes: u64) -> u64 {
        self.w.alloc(self.ctx, bytes as usize, false).unwrap()
    }

    /// Runs blocks `sample` of kernel `name` (of the tensor module when `tensor`) over a
    /// 1-D grid of `grid` blocks of `block` threads; any fault fails the test.
    fn run(&mut self, tensor: bool, name: &str, args: &[A], grid: u32, block: u32, sample: &[u32]) {
        let module = if tensor { self.tensor.clone() } else { self.kernels.clone() };
        let entry = module.function(name).unwrap();
        let f = &module.functions[entry];
        let size = f.params.last().map(|p| p.offset as usize + p.ty.bytes()).unwrap_or(0);
        let mut buf = vec![0u8; size];
        for (p, a) in f.params.iter().zip(args) {
            let v = match a {
                A::U64(v) => *v,
                A::U32(v) => u64::from(*v),
            };
            buf[p.offset as usize..][..p.ty.bytes()].copy_from_slice(&v.to_le_bytes()[..p.ty.bytes()]);
        }
        let limits = interp::Limits { max_instructions: u64::MAX };
        let mut mem = kernels::device_mem(&mut self.w, self.ctx, self.stream);
        let r = interp::run_blocks(&module, entry, [grid, 1, 1], [block, 1, 1], &buf, &mut mem, &limits, Some(sample));
        if let Err(f) = r {
            panic!("{name}, blocks {sample:?} of {grid}: {f}");
        }
    }

    fn u64_at(&mut self, addr: u64) -> u64 {
        u64::from_le_bytes(self.w.read(addr, 8).unwrap().try_into().unwrap())
    }

    fn u32_at(&mut self, addr: u64) -> u32 {
        u32::from_le_bytes(self.w.read(addr, 4).unwrap().try_into().unwrap())
    }
}

/// The blocks of a grid-stride launch whose threads take elements `i - 1` and `i` in the same
/// round: where the byte offset `i · size` crosses a boundary, one block or two adjacent ones.
fn straddling(i: u64) -> [u32; 2] {
    let block = |i: u64| ((i % THREADS) / u64::from(BLOCK)) as u32;
    [block(i - 1), block(i)]
}

/// The first and last blocks and those straddling 2^31 and 2^32 bytes of `size`-byte elements.
fn sample(size: u64) -> Vec<u32> {
    let mut s = vec![0, GRID - 1];
    s.extend(straddling((1 << 31) / size));
    s.extend(straddling((1 << 32) / size));
    s.sort_unstable();
    s.dedup();
    s
}

/// The runs of element indices a grid-stride block takes below `count`: (first, how many),
/// one per round of the grid.
fn runs(block: u32, count: u64) -> impl Iterator<Item = (u64, u64)> {
    let first = u64::from(block) * u64::from(BLOCK);
    (0..count.div_ceil(THREADS))
        .map(move |round| round * THREADS + first)
        .filter(move |i| *i < count)
        .map(move |i| (i, u64::from(BLOCK).min(count - i)))
}

/// The last element index block `block` takes below `count`, and its first at or above `from`.
fn ends(block: u32, count: u64, from: u64) -> [u64; 2] {
    let all: Vec<(u64, u64)> = runs(block, count).collect();
    let last = all.last().map(|(i, n)| i + n - 1).unwrap();
    let above = all.iter().find(|(i, n)| i + n > from).map(|(i, _)| (*i).max(from)).unwrap();
    [last, above]
}

/// A block no sample runs, for the check that skipped blocks write nothing.
fn skipped(sample: &[u32]) -> u32 {
    (1..GRID).find(|b| !sample.contains(b)).unwrap()
}

/// The 64-bit words at `[addr, addr + 8·n)`.
fn words_at(g: &mut Big, addr: u64, n: u64) -> Vec<u64> {
    let b = g.w.read(addr, (8 * n) as usize).unwrap();
    b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect()
}

/// 4.5 GiB of 64-bit words: byte offsets cross 2^31 and 2^32. The probe's memory test launches
/// on chunks of at most 1 GiB (src/probe/kernels.rs, `allocate`), which never cross; the
/// kernels' contract takes any count, and a chunk size is one constant away.
const WORDS: u64 = (4 * GIB + GIB / 2) / 8;

#[test]
fn mem_write_at_4_5_gib_sampled() {
    let mut g = Big::new();
    let buf = g.alloc(WORDS * 8);
    let blocks = sample(8);
    g.run(false, "phq_mem_write", &[A::U64(buf), A::U64(WORDS), A::U32(1), A::U64(0)], GRID, BLOCK, &blocks);
    for &b in &blocks {
        for (i, n) in runs(b, WORDS) {
            let at = buf + 8 * i;
            let want: Vec<u64> = (0..n).map(|k| at + 8 * k).collect();
            assert_eq!(words_at(&mut g, at, n), want, "block {b}: words {i}.. hold their addresses");
        }
    }
    let i = u64::from(skipped(&blocks)) * u64::from(BLOCK);
    assert_eq!(g.u64_at(buf + 8 * i), 0, "a block not sampled writes nothing");
}

/// The check finds the words planted wrong where the sampled blocks read (below and above
/// 4 GiB), records them by address, and rewrites every word the blocks take with the next
/// pattern.
#[test]
fn mem_check_at_4_5_gib_sampled() {
    let mut g = Big::new();
    let buf = g.alloc(WORDS * 8);
    let result = g.alloc(200);
    g.w.allocs.get_mut(&buf).unwrap().mem = Mem::Pattern { mode: 1, arg: 0 };
    let blocks = sample(8);
    let mut planted = Vec::new();
    // Each block's last word (above 4 GiB), and the first two blocks' first above 2 GiB: at
    // most the eight mismatches a result keeps.
    for (k, &b) in blocks.iter().enumerate() {
        for i in ends(b, WORDS, (1 << 31) / 8).into_iter().take(if k < 2 { 2 } else { 1 }) {
            let at = buf + 8 * i;
            g.w.write(at, &(at ^ 0x10).to_le_bytes()).unwrap();
            planted.push([at, at ^ 0x10, at]);
        }
    }
    planted.sort_unstable();
    planted.dedup();
    assert!(planted.len() <= 8, "every mismatch kept");
    let args = [A::U64(buf), A::U64(WORDS), A::U32(1), A::U64(0), A::U32(2), A::U64(0), A::U32(0), A::U64(result)];
    g.run(false, "phq_mem_check", &args, GRID, BLOCK, &blocks);
    let count = g.u64_at(result);
    let mut recs: Vec<[u64; 3]> =
        (0..count.min(8)).map(|s| std::array::from_fn(|k| g.u64_at(result + 8 + 24 * s + 8 * k as u64))).collect();
    recs.sort_unstable();
    assert_eq!((count, recs), (planted.len() as u64, planted), "the planted words, by address");
    for &b in &blocks {
        for (i, n) in runs(b, WORDS) {
            let at = buf + 8 * i;
            let want: Vec<u64> = (0..n).map(|k| !(at + 8 * k)).collect();
            assert_eq!(words_at(&mut g, at, n), want, "block {b}: words {i}.. rewritten with the next pattern");
        }
    }
    let i = u64::from(skipped(&blocks)) * u64::from(BLOCK);
    assert_eq!(g.u64_at(buf + 8 * i), buf + 8 * i, "a block not sampled rewrites nothing");
}

/// 4.5 GiB copied in 16-byte vectors: source and destination offsets cross 2^31 and 2^32.
/// The probe's SM copy moves `buffer_bytes` per level (src/probe/cuda_backend/copies.rs).
#[test]
fn copy_sm_at_4_5_gib_sampled() {
    let mut g = Big::new();
    let count = (4 * GIB + GIB / 2) / 16;
    let (src, dst) = (g.alloc(count * 16), g.alloc(count * 16));
    g.w.allocs.get_mut(&src).unwrap().mem = Mem::Pattern { mode: 1, arg: 0 };
    let blocks = sample(16);
    g.run(false, "phq_copy_sm", &[A::U64(dst), A::U64(src), A::U64(count)], GRID, BLOCK, &blocks);
    for &b in &blocks {
        for (i, n) in runs(b, count) {
            let want: Vec<u64> = (0..2 * n).map(|k| src + 16 * i + 8 * k).collect();
            assert_eq!(
                words_at(&mut g, dst + 16 * i, 2 * n),
                want,
                "block {b}: vectors {i}.. copied from their source"
            );
        }
    }
    let i = u64::from(skipped(&blocks)) * u64::from(BLOCK);
    assert_eq!(g.u64_at(dst + 16 * i), 0, "a block not sampled copies nothing");
}

/// C of n = 32784 (the first multiple of 16 whose n² entries take more than 2^32 bytes; the
/// probes check on the GPU for n below 65536, src/probe/cuda_backend/gemm.rs): every entry
/// 1.0 as the table says but for entries planted where the sampled blocks read, below and above
/// 4 GiB, each found and recorded by its element index.
#[test]
fn gemm_check_at_n_32784_sampled() {
    let mut g = Big::new();
    let n = 32784u64;
    let one = 1.0f32.to_bits();
    let c = g.alloc(n * n * 4);
    let (table, result) = (g.alloc(17 * 17 * 4), g.alloc(200));
    g.w.fill(c, (n * n * 4) as usize, one).unwrap();
    g.w.fill(table, 17 * 17 * 4, one).unwrap();
    let blocks = sample(4);
    let mut planted = Vec::new();
    for (k, &b) in blocks.iter().enumerate() {
        for e in ends(b, n * n, (1 << 31) / 4).into_iter().take(if k < 2 { 2 } else { 1 }) {
            g.w.write(c + 4 * e, &2.0f32.to_le_bytes()).unwrap();
            planted.push([e, u64::from(2.0f32.to_bits()), u64::from(one)]);
        }
    }
    planted.sort_unstable();
    planted.dedup();
    assert!(planted.len() <= 8, "every mismatch kept");
    let args = [A::U64(c), A::U32(n as u32), A::U64(table), A::U64(result)];
    g.run(false, "phq_gemm_check", &args, GRID, BLOCK, &blocks);
    let count = g.u64_at(result);
    let mut recs: Vec<[u64; 3]> =
        (0..count.min(8)).map(|s| std::array::from_fn(|k| g.u64_at(result + 8 + 24 * s + 8 * k as u64))).collect();
    recs.sort_unstable();
    assert_eq!((count, recs), (planted.len() as u64, planted), "the planted entries, by element index");
}

/// The pointer chase has no index arithmetic: it loads each next address from the last. A
/// chain through one 4.5 GiB allocation, hopping across 2^31 and 2^32 bytes and back, launched
/// as the probes do (one thread, src/probe/kernels.rs `chase_ns`), ends where it should.
#[test]
fn chase_across_4_gib() {
    let mut g = Big::new();
    let buf = g.alloc(WORDS * 8);
    let out = g.alloc(8);
    let hops: Vec<u64> = [0, (1 << 32) + 8, (1 << 31) - 8, 1 << 31, (1 << 32) - 8, WORDS * 8 - 8, 1 << 32]
        .iter()
        .map(|o| buf + o)
        .collect();
    for w in hops.windows(2) {
        g.w.write(w[0], &w[1].to_le_bytes()).unwrap();
    }
    let steps = hops.len() as u64 - 1;
    g.run(false, "phq_chase", &[A::U64(hops[0]), A::U64(steps), A::U64(out)], 1, 1, &[0]);
    assert_eq!(g.u64_at(out), *hops.last().unwrap());
}

// phq_spin has no global-memory index at all: it polls one host word and writes another
// through pointers it is given, on a grid of one thread. There is nothing to cross.

/// C = A·B at n = 32784 (4.3 GB a matrix; the probes' `phq_sgemm` grid of (n/16)² blocks):
/// A and B all 1.0 but for A(i, n − 1) = 2 on each sampled tile's first row and B(n − 1, j) = 3
/// on its first column, which lie above 4 GiB; each sampled tile's 256 entries then hold
/// n − 1 + a(i)·b(j), exact in FP32.
#[test]
fn sgemm_at_n_32784_sampled() {
    let mut g = Big::new();
    let n = 32784u64;
    let one = 1.0f32.to_bits();
    let (a, b, c) = (g.alloc(n * n * 4), g.alloc(n * n * 4), g.alloc(n * n * 4));
    g.w.fill(a, (n * n * 4) as usize, one).unwrap();
    g.w.fill(b, (n * n * 4) as usize, one).unwrap();
    let side = n / 16;
    // Block t computes rows 16·(t mod side).. and columns 16·(t div side).. (kernels.ptx).
    let tile_of = |e: u64| ((e / n / 16) * side + (e % n) / 16) as u32;
    // The first and last tiles and those holding C's bytes at 2^32. Every tile's A offsets run
    // from its rows to 4·n² bytes over its k loop, past 2^31 and 2^32; C's entries at 2^31 bytes
    // are not sampled: each tile costs about 80 million instructions here.
    let mut blocks = vec![0, tile_of((1 << 30) - 1), tile_of(1 << 30), (side * side - 1) as u32];
    blocks.sort_unstable();
    blocks.dedup();
    let (mut rows, mut cols) = (Vec::new(), Vec::new());
    for &t in &blocks {
        let (i, j) = (16 * (u64::from(t) % side), 16 * (u64::from(t) / side));
        g.w.write(a + 4 * (i + (n - 1) * n), &2.0f32.to_le_bytes()).unwrap();
        g.w.write(b + 4 * ((n - 1) + j * n), &3.0f32.to_le_bytes()).unwrap();
        rows.push(i);
        cols.push(j);
    }
    g.run(false, "phq_sgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], (side * side) as u32, 256, &blocks);
    for &t in &blocks {
        let (i0, j0) = (16 * (u64::from(t) % side), 16 * (u64::from(t) / side));
        for j in j0..j0 + 16 {
            for i in i0..i0 + 16 {
                let f = |x: bool, v: f32| if x { v } else { 1.0 };
                let want = (n - 1) as f32 + f(rows.contains(&i), 2.0) * f(cols.contains(&j), 3.0);
                assert_eq!(f32::from_bits(g.u32_at(c + 4 * (i + j * n))), want, "block {t}: C({i},{j})");
            }
        }
    }
}

/// The FP64 GEMM at n = 23184, the first multiple of 16 whose n² 8-byte entries pass 2^32
/// bytes (the probes' `phq_dgemm` grid, `phq_sgemm`'s: (n/16)² blocks). A and B are zero (the
/// fill word 0 is FP64 0.0) but for each sampled tile's rows of A and columns of B at k = n/2 and
/// k = n − 1, where A holds 2 and 1 and B 3 and 1: every entry of a sampled tile is 2·3 + 1·1 = 7,
/// exact, and only an address that reaches those entries above 4 GiB gets it. Sampled, for time
/// (about 55 million instructions a tile here): the tile holding C's bytes at 2^32 and the last.
#[test]
fn dgemm_at_n_23184_sampled() {
    let mut g = Big::new();
    let n = 23184u64;
    let (a, b, c) = (g.alloc(n * n * 8), g.alloc(n * n * 8), g.alloc(n * n * 8));
    g.w.fill(a, (n * n * 8) as usize, 0).unwrap();
    g.w.fill(b, (n * n * 8) as usize, 0).unwrap();
    let side = n / 16;
    let tile_of = |e: u64| ((e / n / 16) * side + (e % n) / 16) as u32;
    let blocks = vec![tile_of((1 << 32) / 8), (side * side - 1) as u32];
    for &t in &blocks {
        let (i0, j0) = (16 * (u64::from(t) % side), 16 * (u64::from(t) / side));
        for (k, va, vb) in [(n / 2, 1.0f64, 1.0f64), (n - 1, 2.0, 3.0)] {
            for d in 0..16 {
                g.w.write(a + 8 * (i0 + d + k * n), &va.to_le_bytes()).unwrap();
                g.w.write(b + 8 * (k + (j0 + d) * n), &vb.to_le_bytes()).unwrap();
            }
        }
    }
    g.run(false, "phq_dgemm", &[A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32)], (side * side) as u32, 256, &blocks);
    for &t in &blocks {
        let (i0, j0) = (16 * (u64::from(t) % side), 16 * (u64::from(t) / side));
        for j in j0..j0 + 16 {
            for i in i0..i0 + 16 {
                let got = g.w.read(c + 8 * (i + j * n), 8).unwrap();
                assert_eq!(f64::from_le_bytes(got.try_into().unwrap()), 7.0, "block {t}: C({i},{j})");
            }
        }
    }
}

/// The tensor-core GEMM at n = 46352 (the probes' `phq_mma_gemm` grid of (n/16)·(n/8)/4
/// blocks of four warps, BF16 inputs): the first multiple of 16 whose n² 2-byte inputs take
/// more than 2^32 bytes, so A's and B's offsets cross 4 GiB, and C's element index crosses
/// 2^31. Sampled: the first block, the last (its A rows and B columns lie above 4 GiB), and
/// those whose tiles hold the C entries at 2^31 and 2^32 bytes and at element 2^31. A and B are
/// all 1.0 but for A(i, n − 1) = 2 on each sampled tile's first row and B(n − 1, j) = 3 on its
/// first column; every entry of a sampled tile holds n − 1 + a(i)·b(j), exact in FP32.
#[test]
fn mma_gemm_at_n_46352_sampled() {
    let mut g = Big::new();
    let n = 46352u64;
    // BF16 is FP32's top half: 1.0 is 0x3f80 (FP32 0x3f800000).
    let bf16 = |x: f32| (x.to_bits() >> 16) as u16;
    let (a, b, c) = (g.alloc(n * n * 2), g.alloc(n * n * 2), g.alloc(n * n * 4));
    let ones = u32::from(bf16(1.0)) * 0x1_0001;
    g.w.fill(a, (n * n * 2) as usize, ones).unwrap();
    g.w.fill(b, (n * n * 2) as usize, ones).unwrap();
    let rows_t = n / 16;
    let tiles = rows_t * (n / 8);
    // Warp v of block t computes tile 4t + v, tiles numbered down the columns (tensor.ptx).
    let block_of = |e: u64| (((e / n / 8) * rows_t + (e % n) / 16) / 4) as u32;
    let mut blocks = vec![0, ((tiles - 1) / 4) as u32];
    for e in [1u64 << 29, 1 << 30, 1 << 31] {
        blocks.extend([block_of(e - 1), block_of(e)]);
    }
    blocks.sort_unstable();
    blocks.dedup();
    let tiles_of = |t: u32| (4 * u64::from(t)..4 * u64::from(t) + 4).filter(move |x| *x < tiles);
    let (mut rows, mut cols) = (Vec::new(), Vec::new());
    for &t in &blocks {
        for tile in tiles_of(t) {
            let (i, j) = (16 * (tile % rows_t), 8 * (tile / rows_t));
            g.w.write(a + 2 * (i * n + n - 1), &bf16(2.0).to_le_bytes()).unwrap();
            g.w.write(b + 2 * ((n - 1) + j * n), &bf16(3.0).to_le_bytes()).unwrap();
            rows.push(i);
            cols.push(j);
        }
    }
    let args = [A::U64(a), A::U64(b), A::U64(c), A::U32(n as u32), A::U32(0)];
    g.run(true, "phq_mma_gemm", &args, tiles.div_ceil(4) as u32, 128, &blocks);
    for &t in &blocks {
        for tile in tiles_of(t) {
            let (i0, j0) = (16 * (tile % rows_t), 8 * (tile / rows_t));
            for j in j0..j0 + 8 {
                for i in i0..i0 + 16 {
                    let f = |x: bool, v: f32| if x { v } else { 1.0 };
                    let want = (n - 1) as f32 + f(rows.contains(&i), 2.0) * f(cols.contains(&j), 3.0);
                    assert_eq!(f32::from_bits(g.u32_at(c + 4 * (i + j * n))), want, "block {t}: C({i},{j})");
                }
            }
        }
    }
}

/// Sparse memory: writes into a 60 GiB allocation hold only the pages they touch, a page
/// written in part keeps the rule's bytes around the write (a word's phase, the pattern of each
/// address), and a whole-allocation fill drops the pages.
#[test]
fn device_memory_costs_the_pages_written() {
    let mut g = Big::new();
    let len = 60 * GIB;
    let buf = g.alloc(len);
    let pages = |g: &Big| match &g.w.allocs[&buf].mem {
        Mem::Pages { pages, .. } => pages.len(),
        Mem::Fill(_) | Mem::Pattern { .. } => 0,
    };
    g.w.fill(buf, len as usize, 0x0403_0201).unwrap();
    for at in [3, (1 << 32) - 1, len - 5] {
        g.w.write(buf + at, &[0xEE, 0xFF]).unwrap();
    }
    assert_eq!(pages(&g), 4, "three writes, one across a page boundary");
    assert_eq!(g.w.read(buf, 8).unwrap(), [1, 2, 3, 0xEE, 0xFF, 2, 3, 4]);
    assert_eq!(g.w.read(buf + (1 << 32) - 4, 6).unwrap(), [1, 2, 3, 0xEE, 0xFF, 2]);
    assert_eq!(g.w.read(buf + len - 6, 6).unwrap(), [3, 0xEE, 0xFF, 2, 3, 4]);
    g.w.allocs.get_mut(&buf).unwrap().mem = Mem::Pattern { mode: 1, arg: 0 };
    // The high half of one word above 4 GiB zeroed: its low half and its neighbours keep
    // their addresses.
    let at = buf + (1 << 32) + 8;
    g.w.write(at + 4, &[0u8; 4]).unwrap();
    assert_eq!(words_at(&mut g, at - 8, 3), [at - 8, at & 0xffff_ffff, at + 8], "the pattern around a write");
    assert_eq!(pages(&g), 1);
    g.w.fill(buf, len as usize, 7).unwrap();
    assert_eq!(pages(&g), 0, "a whole fill is one word again");
}

/// Why the sampling: the copy kernel with its vector offset shifted in 32 bits (a mutant
/// ptxas accepts for sm_90) copies a small buffer right, as every launch of `tests_ptx` does,
/// and writes the wrong place once the offset passes 4 GiB, which the block straddling it shows.
#[test]
fn a_32_bit_offset_passes_small_launches_and_fails_above_4_gib() {
    let from = "    shl.b64 %rd7, %rd4, 4;\n    add.u64 %rd8, %rd2, %rd7;";
    let to = "    cvt.u32.u64 %r9, %rd4;\n    shl.b32 %r9, %r9, 4;\n    cvt.u64.u32 %rd7, %r9;\n    add.u64 %rd8, %rd2, %rd7;";
    assert_eq!(PTX.matches(from).count(), 1, "the copy's offset, as kernels.ptx writes it");
    let mut g = Big::new();
    g.kernels = Arc::new(ptx::parse(&PTX.replacen(from, to, 1)).unwrap());
    let copied = |g: &mut Big, src: u64, dst: u64, i: u64, n: u64| {
        words_at(g, dst + 16 * i, 2 * n) == (0..2 * n).map(|k| src + 16 * i + 8 * k).collect::<Vec<u64>>()
    };
    let small = 3000;
    let (src, dst) = (g.alloc(small * 16), g.alloc(small * 16));
    g.w.allocs.get_mut(&src).unwrap().mem = Mem::Pattern { mode: 1, arg: 0 };
    g.run(false, "phq_copy_sm", &[A::U64(dst), A::U64(src), A::U64(small)], 5, BLOCK, &[0, 1, 2, 3, 4]);
    assert!(copied(&mut g, src, dst, 0, small), "a small copy is right even so");
    let count = (4 * GIB + GIB / 2) / 16;
    let (src, dst) = (g.alloc(count * 16), g.alloc(count * 16));
    g.w.allocs.get_mut(&src).unwrap().mem = Mem::Pattern { mode: 1, arg: 0 };
    let straddling = straddling((1 << 32) / 16)[1];
    g.run(false, "phq_copy_sm", &[A::U64(dst), A::U64(src), A::U64(count)], GRID, BLOCK, &[straddling]);
    let wrong = runs(straddling, count).filter(|&(i, n)| !copied(&mut g, src, dst, i, n)).count();
    assert!(wrong > 0, "above 4 GiB the mutant's copy lands elsewhere");
}
