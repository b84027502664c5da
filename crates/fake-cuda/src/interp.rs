//! An interpreter for the PTX the agent ships (`ptx` parses it): a launch runs every thread of
//! the grid, and checks every access as NVIDIA's compute-sanitizer would, which a GPU does not.
//!
//! The order: every thread of the grid is resident and issues one instruction per round, in
//! thread order (blocks in order, threads of a block by linear index). A GPU promises no order
//! between threads beyond barriers and atomics (PTX, "Memory Consistency Model"), so a kernel
//! that is right on a GPU is right under any order; this one is deterministic and close to a
//! GPU's for the agent's grid-stride loops (every thread's k-th iteration before any (k+1)-th).
//!
//! What it checks, each a `Fault` that names the kernel, the block, the thread, the line and
//! the instruction:
//! - a global access outside every allocation, into freed memory, or into another GPU's memory
//!   the context has no peer access to: CUDA_ERROR_ILLEGAL_ADDRESS (700), as compute-sanitizer's
//!   memcheck reports "Invalid __global__ read/write" and the GPU raises for unmapped memory;
//! - an access not aligned to its size (a vector's whole size): CUDA_ERROR_MISALIGNED_ADDRESS
//!   (716; PTX, "Addresses as Operands": "the address must be naturally aligned to a multiple
//!   of the access size");
//! - a shared access outside the block's shared variables: 700;
//! - a read of a register never written (compute-sanitizer's initcheck reports uninitialised
//!   device memory; a register is the same mistake one level down): CUDA_ERROR_LAUNCH_FAILED;
//! - a read of a shared word no thread of the block has written: a block's shared memory starts
//!   with whatever the SM last held there (CUDA C++ Programming Guide, "__shared__": a shared
//!   variable cannot be initialised in its declaration; its content at block start is
//!   undefined), so the fake fills it with garbage and refuses the read as it refuses an
//!   unwritten register: CUDA_ERROR_LAUNCH_FAILED;
//! - two threads of a block touching one shared word between barriers, one of them writing
//!   (compute-sanitizer's racecheck: write-after-write, read-after-write, write-after-read
//!   hazards): CUDA_ERROR_LAUNCH_FAILED;
//! - `bar.sync` waited on by some threads of a block after others exited: a GPU would hang
//!   there; reported as CUDA_ERROR_LAUNCH_TIMEOUT (702), as is a launch past its instruction
//!   budget (a loop that never ends);
//! - an integer division by zero (PTX, "div": the result is unspecified): LAUNCH_FAILED;
//! - a warp-wide `mma.sync.aligned` that not every thread of a full warp reaches at the same
//!   instruction (PTX, "mma": `.aligned` "requires all threads in the warp to execute the same
//!   mma instruction"; otherwise the behaviour is undefined): CUDA_ERROR_ILLEGAL_INSTRUCTION (715).
//!
//! `mma.sync` runs once for the warp, when its 32 threads have all arrived: each element of D is
//! the sum over k of A·B plus C, from the fragments each lane holds as the PTX ISA lays them out
//! ("Matrix Fragments for mma.m16n8k16 with floating point type"). The ISA leaves the order and
//! internal precision of a tensor core's sums unspecified; the interpreter adds the products to
//! C in k order in FP32, which is exact for what the agent multiplies (small integers whose sums stay below 2^24).

use crate::codes::CUresult;
use crate::ptx::{Addr, Base, Bin, Cmp, Function, Instr, Module, Op, Operand, Space, Special, Ty};

pub const ILLEGAL_ADDRESS: CUresult = 700;
pub const LAUNCH_TIMEOUT: CUresult = 702;
pub const ILLEGAL_INSTRUCTION: CUresult = 715;
pub const MISALIGNED_ADDRESS: CUresult = 716;
pub const LAUNCH_FAILED: CUresult = 719;
pub const NOT_SUPPORTED: CUresult = 801;

/// Global memory as a launch sees it.
pub trait Memory {
    /// Reads `out.len()` bytes at `addr`. `uncached`: a `.cv` or volatile load, which fetches
    /// the word from its memory again (the caller charges that memory's latency).
    fn load(&mut self, addr: u64, out: &mut [u8], uncached: bool) -> Result<(), String>;
    fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String>;
    /// The GPU's %globaltimer (nanoseconds) when the launch started.
    fn timer_start(&self) -> u64;
}

/// Why a launch failed, and where.
#[derive(Debug, Clone, PartialEq)]
pub struct Fault {
    pub code: CUresult,
    pub kernel: String,
    pub block: [u32; 3],
    pub thread: [u32; 3],
    pub line: usize,
    pub instr: String,
    pub message: String,
}

impl std::fmt::Display for Fault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [bx, by, bz] = self.block;
        let [tx, ty, tz] = self.thread;
        write!(
            f,
            "{}: block ({bx},{by},{bz}) thread ({tx},{ty},{tz}), line {} `{}`: {} (CUDA error {})",
            self.kernel, self.line, self.instr, self.message, self.code
        )
    }
}

pub struct Limits {
    /// Thread-instructions a launch may execute before it counts as hung.
    pub max_instructions: u64,
}

#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct Stats {
    pub instructions: u64,
    pub rounds: u64,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Run,
    Barrier,
    /// Arrived at a warp-collective instruction (`mma.sync`), waiting for the rest of its warp.
    Warp,
    Done,
}

struct Frame {
    func: usize,
    pc: usize,
    regs: Vec<u64>,
    init: Vec<bool>,
    /// The caller's registers that receive this call's results.
    rets: Vec<u16>,
}

struct Thread {
    frames: Vec<Frame>,
    state: State,
}

/// Who last touched a shared word, in which barrier epoch (0: never).
#[derive(Clone, Copy, Default)]
struct Word {
    writer: u32,
    written: u32,
    reader: u32,
    read: u32,
    /// More than one thread read it in epoch `read`.
    readers: bool,
}

/// What a block's shared memory holds before the block writes it: bytes of an xorshift stream
/// seeded by the block's index, never the zeroes a kernel might silently count on.
fn garbage(len: usize, block: u32) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(block).wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

struct Block {
    shared: Vec<u8>,
    words: Vec<Word>,
    epoch: u32,
    running: u32,
    waiting: u32,
    done: u32,
}

struct Launch<'a> {
    m: &'a Module,
    entry: &'a Function,
    grid: [u32; 3],
    block: [u32; 3],
    params: &'a [u8],
    per_block: u32,
    /// The grid index of each block run, by its place in the thread list.
    ids: Vec<u32>,
    round: u64,
    timer: u64,
}

fn mask(ty: Ty) -> u64 {
    match ty.bits() {
        64 => u64::MAX,
        b => (1u64 << b) - 1,
    }
}

/// The value as a signed 64-bit integer, from `ty`'s width.
fn sext(v: u64, ty: Ty) -> i64 {
    let b = ty.bits();
    if b >= 64 {
        v as i64
    } else {
        ((v << (64 - b)) as i64) >> (64 - b)
    }
}

fn coords(i: u32, dim: [u32; 3]) -> [u32; 3] {
    [i % dim[0], i / dim[0] % dim[1], i / (dim[0] * dim[1])]
}

/// Runs entry `entry` of `m` over the grid, `params` laid out as its `.param` declarations
/// say (`Function::params`).
pub fn run(
    m: &Module,
    entry: usize,
    grid: [u32; 3],
    block: [u32; 3],
    params: &[u8],
    mem: &mut dyn Memory,
    limits: &Limits,
) -> Result<Stats, Fault> {
    run_blocks(m, entry, grid, block, params, mem, limits, None)
}

/// `run` for the blocks `only` names (linear indices into the grid) when given: each sees its
/// own %ctaid and the whole grid's %nctaid, as in the full launch; the other blocks do not run
/// at all. Blocks of one launch share nothing but global memory, so a sampled block computes
/// what it would in the full grid, unless it reads what a skipped block writes. For tests that
/// sample a grid too big to interpret whole.
#[allow(clippy::too_many_arguments)]
pub fn run_blocks(
    m: &Module,
    entry: usize,
    grid: [u32; 3],
    block: [u32; 3],
    params: &[u8],
    mem: &mut dyn Memory,
    limits: &Limits,
    only: Option<&[u32]>,
) -> Result<Stats, Fault> {
    let f = &m.functions[entry];
    let per_block = block[0] * block[1] * block[2];
    let ids: Vec<u32> = match only {
        Some(o) => o.to_vec(),
        None => (0..grid[0] * grid[1] * grid[2]).collect(),
    };
    let blocks = ids.len() as u32;
    let mut l = Launch { m, entry: f, grid, block, params, per_block, ids, round: 0, timer: mem.timer_start() };
    if let Some(i) = m.unsupported_in(entry) {
        return Err(l.fault(0, i, NOT_SUPPORTED, format!("the fake's PTX interpreter does not execute `{}`", i.text)));
    }
    let words = (f.shared_bytes as usize).div_ceil(4);
    let mut bstate: Vec<Block> = (0..blocks)
        .map(|b| Block {
            shared: garbage(f.shared_bytes as usize, l.ids[b as usize]),
            words: vec![Word::default(); words],
            epoch: 1,
            running: per_block,
            waiting: 0,
            done: 0,
        })
        .collect();
    let nregs = f.regs.len();
    let mut threads: Vec<Thread> = (0..blocks * per_block)
        .map(|_| Thread {
            frames: vec![Frame { func: entry, pc: 0, regs: vec![0; nregs], init: vec![false; nregs], rets: vec![] }],
            state: State::Run,
        })
        .collect();
    let mut stats = Stats::default();
    loop {
        l.round += 1;
        let mut ran = false;
        for (t, th) in threads.iter_mut().enumerate() {
            if th.state != State::Run {
                continue;
            }
            ran = true;
            stats.instructions += 1;
            if stats.instructions > limits.max_instructions {
                let i = l.current(&threads[t]);
                return Err(l.fault(
                    t as u32,
                    &i,
                    LAUNCH_TIMEOUT,
                    format!(
                        "still running after {} instructions: a loop that does not end hangs the GPU",
                        limits.max_instructions
                    ),
                ));
            }
            let b = (t as u32 / per_block) as usize;
            let before = th.state;
            l.step(t as u32, th, &mut bstate[b], mem)?;
            let after = th.state;
            // A thread waiting for its warp still counts as running for the block's barrier.
            if before != after && after != State::Warp {
                let bs = &mut bstate[b];
                bs.running -= 1;
                match after {
                    State::Barrier => bs.waiting += 1,
                    State::Done => bs.done += 1,
                    State::Run | State::Warp => {}
                }
            }
        }
        let mut released = l.warps(&mut threads)?;
        // Barriers: a block whose threads have all arrived goes on; one whose waiting threads
        // can never be joined (the others exited) is a GPU that hangs.
        for (b, bs) in bstate.iter_mut().enumerate() {
            if bs.running > 0 || bs.waiting == 0 {
                continue;
            }
            let first = b as u32 * per_block;
            let range = first as usize..(first + per_block) as usize;
            if bs.done > 0 {
                let waiter = range.clone().find(|t| threads[*t].state == State::Barrier).unwrap_or(first as usize);
                let gone = range.clone().find(|t| threads[*t].state == State::Done).unwrap_or(first as usize);
                let i = l.previous(&threads[waiter]);
                let [x, y, z] = coords(gone as u32 % per_block, block);
                return Err(l.fault(
                    waiter as u32,
                    &i,
                    LAUNCH_TIMEOUT,
                    format!("bar.sync waits for thread ({x},{y},{z}) of its block, which has exited: a GPU hangs here"),
                ));
            }
            for t in range {
                threads[t].state = State::Run;
            }
            bs.running = bs.waiting;
            bs.waiting = 0;
            bs.epoch += 1;
            released = true;
        }
        stats.rounds = l.round;
        if !ran && !released {
            return Ok(stats);
        }
    }
}

impl Launch<'_> {
    /// The grid index of thread `t`'s block.
    fn block_of(&self, t: u32) -> u32 {
        self.ids.get((t / self.per_block.max(1)) as usize).copied().unwrap_or(0)
    }

    fn fault(&self, t: u32, i: &Instr, code: CUresult, message: String) -> Fault {
        let b = self.block_of(t);
        Fault {
            code,
            kernel: self.entry.name.clone(),
            block: coords(b, self.grid),
            thread: coords(t % self.per_block, self.block),
            line: i.line,
            instr: i.text.clone(),
            message,
        }
    }

    /// The instruction a thread is at (or a placeholder past the end).
    fn current(&self, th: &Thread) -> Instr {
        th.frames.last().and_then(|fr| self.m.functions[fr.func].code.get(fr.pc)).cloned().unwrap_or(Instr {
            guard: None,
            op: Op::Ret,
            text: "(end)".into(),
            line: 0,
        })
    }

    /// The instruction before the one a thread is at: the barrier it waits at.
    fn previous(&self, th: &Thread) -> Instr {
        th.frames
            .last()
            .and_then(|fr| self.m.functions[fr.func].code.get(fr.pc.wrapping_sub(1)))
            .cloned()
            .unwrap_or(Instr { guard: None, op: Op::BarSync, text: "bar.sync 0".into(), line: 0 })
    }

    fn special(&self, t: u32, s: Special) -> u64 {
        let b = self.block_of(t);
        let local = t % self.per_block;
        u64::from(match s {
            Special::Tid(d) => coords(local, self.block)[d],
            Special::Ntid(d) => self.block[d],
            Special::Ctaid(d) => coords(b, self.grid)[d],
            Special::Nctaid(d) => self.grid[d],
            Special::LaneId => local % 32,
            // One round of the grid is taken as a nanosecond: a GPU issues about one
            // instruction per warp per clock at 1–2 GHz.
            Special::GlobalTimer => return self.timer + self.round,
        })
    }

    fn step(&self, t: u32, th: &mut Thread, bs: &mut Block, mem: &mut dyn Memory) -> Result<(), Fault> {
        let m = self.m;
        let depth = th.frames.len();
        let Some(fr) = th.frames.last_mut() else {
            th.state = State::Done;
            return Ok(());
        };
        let func = &m.functions[fr.func];
        let Some(i) = func.code.get(fr.pc) else {
            // Past the last instruction: a return.
            return self.ret(th, &Instr { guard: None, op: Op::Ret, text: "(end of function)".into(), line: 0 }, t);
        };
        let fault = |code: CUresult, msg: String| self.fault(t, i, code, msg);
        let read = |fr: &Frame, o: &Operand, ty: Ty| -> Result<u64, Fault> {
            match o {
                Operand::Reg(r) => {
                    if !fr.init[*r as usize] {
                        return Err(fault(
                            LAUNCH_FAILED,
                            format!("reads {}, which was never written", func.regs[*r as usize].name),
                        ));
                    }
                    Ok(fr.regs[*r as usize] & mask(ty))
                }
                Operand::Imm(v) => Ok(v & mask(ty)),
                Operand::Special(s) => Ok(self.special(t, *s) & mask(ty)),
                Operand::Shared(off) => Ok(u64::from(*off) & mask(ty)),
            }
        };
        if let Some((p, neg)) = i.guard {
            let v = read(fr, &Operand::Reg(p), Ty::Pred)?;
            if (v != 0) == neg {
                fr.pc += 1;
                return Ok(());
            }
        }
        let write = |fr: &mut Frame, r: u16, v: u64| {
            let ty = func.regs[r as usize].ty;
            fr.regs[r as usize] = v & mask(ty);
            fr.init[r as usize] = true;
        };
        match &i.op {
            Op::Bin { op, ty, dst, a, b } => {
                let (x, y) =
                    (read(fr, a, *ty)?, read(fr, b, if matches!(op, Bin::Shl | Bin::Shr) { Ty::U32 } else { *ty })?);
                let w = ty.bits();
                let s = ty.signed();
                let v = match op {
                    // PTX, "add", "sub", "mul": wrap around at the type's width.
                    Bin::Add => x.wrapping_add(y),
                    Bin::Sub => x.wrapping_sub(y),
                    Bin::MulLo => x.wrapping_mul(y),
                    Bin::MulHi => {
                        if s {
                            ((i128::from(sext(x, *ty)) * i128::from(sext(y, *ty))) >> w) as u64
                        } else {
                            ((u128::from(x) * u128::from(y)) >> w) as u64
                        }
                    }
                    Bin::Div | Bin::Rem => {
                        if y == 0 {
                            return Err(fault(
                                LAUNCH_FAILED,
                                "divides by zero (PTX, \"div\": the result is unspecified)".into(),
                            ));
                        }
                        match (op, s) {
                            (Bin::Div, false) => x / y,
                            (Bin::Rem, false) => x % y,
                            (Bin::Div, true) => sext(x, *ty).wrapping_div(sext(y, *ty)) as u64,
                            _ => sext(x, *ty).wrapping_rem(sext(y, *ty)) as u64,
                        }
                    }
                    Bin::And => x & y,
                    Bin::Or => x | y,
                    Bin::Xor => x ^ y,
                    // PTX, "shl", "shr": "shift amounts greater than the register width N are
                    // clamped to N"; shr of a signed type fills with the sign bit.
                    Bin::Shl => {
                        if y >= u64::from(w) {
                            0
                        } else {
                            x << y
                        }
                    }
                    Bin::Shr => {
                        let y = y.min(u64::from(w));
                        if s {
                            (sext(x, *ty) >> y.min(63)) as u64
                        } else if y >= u64::from(w) {
                            0
                        } else {
                            x >> y
                        }
                    }
                    Bin::Min | Bin::Max => {
                        let less = if s { sext(x, *ty) < sext(y, *ty) } else { x < y };
                        if (*op == Bin::Min) == less {
                            x
                        } else {
                            y
                        }
                    }
                };
                write(fr, *dst, v & mask(*ty));
            }
            Op::MulWide { ty, dst, a, b } => {
                let (x, y) = (read(fr, a, *ty)?, read(fr, b, *ty)?);
                let v = if ty.signed() { (sext(x, *ty) * sext(y, *ty)) as u64 } else { x * y };
                write(fr, *dst, v);
            }
            Op::MadLo { ty, dst, a, b, c } => {
                let v = read(fr, a, *ty)?.wrapping_mul(read(fr, b, *ty)?).wrapping_add(read(fr, c, *ty)?);
                write(fr, *dst, v & mask(*ty));
            }
            Op::Not { ty, dst, a } => {
                let v = read(fr, a, *ty)?;
                write(fr, *dst, if *ty == Ty::Pred { u64::from(v == 0) } else { !v & mask(*ty) });
            }
            // PTX, "cvt": integer conversions sign- or zero-extend from the source type, and
            // truncate to a narrower destination.
            Op::Cvt { to, from, dst, a } => {
                let v = read(fr, a, *from)?;
                let wide = if from.signed() { sext(v, *from) as u64 } else { v };
                write(fr, *dst, wide & mask(*to));
            }
            Op::Setp { cmp, ty, dst, a, b } => {
                let (x, y) = (read(fr, a, *ty)?, read(fr, b, *ty)?);
                let ord = if ty.float() {
                    let (x, y) = if *ty == Ty::F32 {
                        (f64::from(f32::from_bits(x as u32)), f64::from(f32::from_bits(y as u32)))
                    } else {
                        (f64::from_bits(x), f64::from_bits(y))
                    };
                    // Ordered comparisons are false when either operand is NaN (PTX, "setp").
                    x.partial_cmp(&y)
                } else if ty.signed() {
                    Some(sext(x, *ty).cmp(&sext(y, *ty)))
                } else {
                    Some(x.cmp(&y))
                };
                use std::cmp::Ordering::*;
                let v = match (cmp, ord) {
                    (Cmp::Ne, None) => false,
                    (_, None) => false,
                    (Cmp::Eq, Some(o)) => o == Equal,
                    (Cmp::Ne, Some(o)) => o != Equal,
                    (Cmp::Lt, Some(o)) => o == Less,
                    (Cmp::Le, Some(o)) => o != Greater,
                    (Cmp::Gt, Some(o)) => o == Greater,
                    (Cmp::Ge, Some(o)) => o != Less,
                };
                write(fr, *dst, u64::from(v));
            }
            Op::Selp { ty, dst, a, b, p } => {
                let (x, y, c) = (read(fr, a, *ty)?, read(fr, b, *ty)?, read(fr, p, Ty::Pred)?);
                write(fr, *dst, if c != 0 { x } else { y });
            }
            Op::Fma { ty: Ty::F64, dst, a, b, c } => {
                let f = f64::from_bits;
                let v = f(read(fr, a, Ty::F64)?).mul_add(f(read(fr, b, Ty::F64)?), f(read(fr, c, Ty::F64)?));
                write(fr, *dst, v.to_bits());
            }
            Op::Fma { dst, a, b, c, .. } => {
                let f = |v: u64| f32::from_bits(v as u32);
                let v = f(read(fr, a, Ty::F32)?).mul_add(f(read(fr, b, Ty::F32)?), f(read(fr, c, Ty::F32)?));
                write(fr, *dst, u64::from(v.to_bits()));
            }
            Op::Mov { ty, dst, src } => {
                let v = read(fr, src, *ty)?;
                write(fr, *dst, v);
            }
            Op::Ld { space, ty, dst, addr, uncached, .. } => {
                let size = ty.bytes();
                let total = size * dst.len();
                let at = self.address(fr, addr, &read)?;
                let mut buf = vec![0u8; total];
                self.access(t, i, bs, *space, at, &mut buf, false, *uncached, mem)?;
                for (k, r) in dst.iter().enumerate() {
                    let mut word = [0u8; 8];
                    word[..size].copy_from_slice(&buf[k * size..(k + 1) * size]);
                    let v = u64::from_le_bytes(word);
                    let v = if ty.signed() { sext(v, *ty) as u64 } else { v };
                    write(fr, *r, v);
                }
            }
            Op::St { space, ty, src, addr } => {
                let size = ty.bytes();
                let at = self.address(fr, addr, &read)?;
                let mut buf = Vec::with_capacity(size * src.len());
                for o in src {
                    buf.extend_from_slice(&read(fr, o, *ty)?.to_le_bytes()[..size]);
                }
                self.access(t, i, bs, *space, at, &mut buf, true, false, mem)?;
            }
            Op::AtomAdd { space, ty, dst, addr, src } => {
                // One thread at a time: the read-modify-write is atomic by construction.
                let size = ty.bytes();
                let at = self.address(fr, addr, &read)?;
                let add = read(fr, src, *ty)?;
                let mut buf = vec![0u8; size];
                self.access(t, i, bs, *space, at, &mut buf, false, true, mem)?;
                let mut word = [0u8; 8];
                word[..size].copy_from_slice(&buf);
                let old = u64::from_le_bytes(word);
                let mut out = (old.wrapping_add(add) & mask(*ty)).to_le_bytes()[..size].to_vec();
                self.access(t, i, bs, *space, at, &mut out, true, false, mem)?;
                write(fr, *dst, old);
            }
            Op::Bra { target } => {
                fr.pc = *target;
                return Ok(());
            }
            Op::Call { func: callee, rets, args } => {
                let cf = &m.functions[*callee];
                let mut regs = vec![0u64; cf.regs.len()];
                let mut init = vec![false; cf.regs.len()];
                for (a, p) in args.iter().zip(&cf.param_regs) {
                    let ty = cf.regs[*p as usize].ty;
                    regs[*p as usize] = read(fr, a, ty)?;
                    init[*p as usize] = true;
                }
                fr.pc += 1;
                th.frames.push(Frame { func: *callee, pc: 0, regs, init, rets: rets.clone() });
                return Ok(());
            }
            Op::Ret => return self.ret(th, i, t),
            Op::Exit => {
                th.state = State::Done;
                return Ok(());
            }
            Op::Mma { .. } => {
                if depth > 1 {
                    return Err(fault(
                        NOT_SUPPORTED,
                        "mma inside a called function is not executed by the fake".into(),
                    ));
                }
                // The warp runs it together (`warps`); the pc moves on then.
                th.state = State::Warp;
                return Ok(());
            }
            Op::BarSync => {
                if depth > 1 {
                    return Err(fault(
                        NOT_SUPPORTED,
                        "bar.sync inside a called function is not executed by the fake".into(),
                    ));
                }
                fr.pc += 1;
                th.state = State::Barrier;
                return Ok(());
            }
            Op::Unsupported => {
                return Err(fault(NOT_SUPPORTED, format!("the fake's PTX interpreter does not execute `{}`", i.text)))
            }
        }
        if let Some(fr) = th.frames.last_mut() {
            fr.pc += 1;
        }
        Ok(())
    }

    /// Runs the warp-collective instruction of every warp whose threads have all arrived at it;
    /// a warp some of whose threads can no longer arrive is a fault. Returns whether any ran.
    fn warps(&self, threads: &mut [Thread]) -> Result<bool, Fault> {
        let mut ran = false;
        let blocks = threads.len() as u32 / self.per_block.max(1);
        for b in 0..blocks {
            let first = b * self.per_block;
            for w0 in (0..self.per_block).step_by(32) {
                let lanes = first + w0..first + (w0 + 32).min(self.per_block);
                let states: Vec<State> = lanes.clone().map(|t| threads[t as usize].state).collect();
                let Some(arrived) = lanes.clone().find(|t| threads[*t as usize].state == State::Warp) else { continue };
                if states.contains(&State::Run) {
                    continue;
                }
                let i = self.current(&threads[arrived as usize]);
                if states.len() < 32 {
                    return Err(self.fault(
                        arrived,
                        &i,
                        ILLEGAL_INSTRUCTION,
                        format!("mma.sync needs a full warp of 32 threads; this one has {}", states.len()),
                    ));
                }
                let at = |t: u32| threads[t as usize].frames.last().map(|f| (f.func, f.pc));
                if let Some(stray) =
                    lanes.clone().find(|t| threads[*t as usize].state != State::Warp || at(*t) != at(arrived))
                {
                    let why = match threads[stray as usize].state {
                        State::Done => "has exited",
                        State::Barrier => "waits at a barrier",
                        _ => "is at another instruction",
                    };
                    return Err(self.fault(
                        arrived,
                        &i,
                        ILLEGAL_INSTRUCTION,
                        format!("lane {} of the warp {why}: `.aligned` needs every thread of the warp at the same mma (undefined on a GPU)", stray - first - w0),
                    ));
                }
                self.mma(threads, lanes.start, &i)?;
                ran = true;
            }
        }
        Ok(ran)
    }

    /// One warp's `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}` with lanes `l0..l0 + 32`.
    fn mma(&self, threads: &mut [Thread], l0: u32, i: &Instr) -> Result<(), Fault> {
        let Op::Mma { input, d, a, b, c } = &i.op else { return Ok(()) };
        let mut am = [[0f32; 16]; 16];
        let mut bm = [[0f32; 8]; 16];
        let mut cm = [[0f32; 8]; 16];
        for lane in 0..32u32 {
            let t = l0 + lane;
            let Some(fr) = threads[t as usize].frames.last() else { continue };
            let func = &self.m.functions[fr.func];
            let get = |r: u16| -> Result<u64, Fault> {
                if fr.init[r as usize] {
                    Ok(fr.regs[r as usize])
                } else {
                    Err(self.fault(
                        t,
                        i,
                        LAUNCH_FAILED,
                        format!("reads {}, which was never written", func.regs[r as usize].name),
                    ))
                }
            };
            // PTX, "Matrix Fragments for mma.m16n8k16 with floating point type".
            let (g, tig) = ((lane >> 2) as usize, (lane % 4) as usize);
            for (k, r) in a.iter().enumerate() {
                let v = get(*r)?;
                for h in 0..2 {
                    let e = 2 * k + h; // a0..a7, two to a register, the lower half first
                    let row = if e < 2 || (4..6).contains(&e) { g } else { g + 8 };
                    let col = tig * 2 + (e & 1) + if e >= 4 { 8 } else { 0 };
                    am[row][col] = input.to_f32((v >> (16 * h)) as u16);
                }
            }
            for (k, r) in b.iter().enumerate() {
                let v = get(*r)?;
                for h in 0..2 {
                    let e = 2 * k + h; // b0..b3
                    let row = tig * 2 + (e & 1) + if e >= 2 { 8 } else { 0 };
                    bm[row][g] = input.to_f32((v >> (16 * h)) as u16);
                }
            }
            for (e, r) in c.iter().enumerate() {
                let row = if e < 2 { g } else { g + 8 };
                cm[row][tig * 2 + (e & 1)] = f32::from_bits(get(*r)? as u32);
            }
        }
        for lane in 0..32u32 {
            let th = &mut threads[(l0 + lane) as usize];
            let Some(fr) = th.frames.last_mut() else { continue };
            let (g, tig) = ((lane >> 2) as usize, (lane % 4) as usize);
            for (e, r) in d.iter().enumerate() {
                let (row, col) = (if e < 2 { g } else { g + 8 }, tig * 2 + (e & 1));
                let mut sum = cm[row][col];
                for (k, arow) in am[row].iter().enumerate() {
                    sum += arow * bm[k][col];
                }
                fr.regs[*r as usize] = u64::from(sum.to_bits());
                fr.init[*r as usize] = true;
            }
            fr.pc += 1;
            th.state = State::Run;
        }
        Ok(())
    }

    fn ret(&self, th: &mut Thread, i: &Instr, t: u32) -> Result<(), Fault> {
        let Some(done) = th.frames.pop() else {
            th.state = State::Done;
            return Ok(());
        };
        let Some(caller) = th.frames.last_mut() else {
            th.state = State::Done;
            return Ok(());
        };
        let cf = &self.m.functions[done.func];
        let callerf = &self.m.functions[caller.func];
        for (dst, src) in done.rets.iter().zip(&cf.ret_regs) {
            if !done.init[*src as usize] {
                return Err(self.fault(
                    t,
                    i,
                    LAUNCH_FAILED,
                    format!("{} returns {}, which was never written", cf.name, cf.regs[*src as usize].name),
                ));
            }
            let ty = callerf.regs[*dst as usize].ty;
            caller.regs[*dst as usize] = done.regs[*src as usize] & mask(ty);
            caller.init[*dst as usize] = true;
        }
        Ok(())
    }

    fn address(
        &self,
        fr: &Frame,
        a: &Addr,
        read: &dyn Fn(&Frame, &Operand, Ty) -> Result<u64, Fault>,
    ) -> Result<(Base, u64), Fault> {
        let base = match &a.base {
            Base::Reg(r) => read(fr, &Operand::Reg(*r), Ty::U64)?,
            Base::Param(off) | Base::Shared(off) => u64::from(*off),
            Base::Abs => 0,
        };
        Ok((a.base, base.wrapping_add(a.offset as u64)))
    }

    /// One load (`data` filled) or store (`data` written) of `data.len()` bytes.
    #[allow(clippy::too_many_arguments)]
    fn access(
        &self,
        t: u32,
        i: &Instr,
        bs: &mut Block,
        space: Space,
        (base, at): (Base, u64),
        data: &mut [u8],
        store: bool,
        uncached: bool,
        mem: &mut dyn Memory,
    ) -> Result<(), Fault> {
        let n = data.len() as u64;
        let kind = if store { "write" } else { "read" };
        if at % n != 0 {
            return Err(self.fault(
                t,
                i,
                MISALIGNED_ADDRESS,
                format!("{kind} of {n} bytes at {at:#x}, not aligned to {n}"),
            ));
        }
        match space {
            Space::Param => {
                let range = at as usize..(at + n) as usize;
                match self.params.get(range) {
                    Some(src) if !store && matches!(base, Base::Param(_)) => {
                        data.copy_from_slice(src);
                        Ok(())
                    }
                    _ => Err(self.fault(
                        t,
                        i,
                        ILLEGAL_ADDRESS,
                        format!("param {kind} at {at} outside the {} bytes of parameters", self.params.len()),
                    )),
                }
            }
            Space::Shared => {
                let end = at.checked_add(n).filter(|e| *e <= bs.shared.len() as u64);
                let Some(end) = end else {
                    return Err(self.fault(
                        t,
                        i,
                        ILLEGAL_ADDRESS,
                        format!(
                            "shared {kind} at {at:#x} outside the block's {} bytes of shared memory",
                            bs.shared.len()
                        ),
                    ));
                };
                let local = t % self.per_block;
                for w in (at / 4)..end.div_ceil(4) {
                    let word = &mut bs.words[w as usize];
                    let other_wrote = word.written == bs.epoch && word.writer != local;
                    if store {
                        let other_read = word.read == bs.epoch && (word.readers || word.reader != local);
                        if other_wrote || other_read {
                            let (what, who) = if other_wrote {
                                ("write-after-write", word.writer)
                            } else {
                                ("write-after-read", word.reader)
                            };
                            let [x, y, z] = coords(who, self.block);
                            return Err(self.fault(t, i, LAUNCH_FAILED, format!("a race on shared word {:#x} ({what}): thread ({x},{y},{z}) touched it since the last barrier", w * 4)));
                        }
                        word.writer = local;
                        word.written = bs.epoch;
                    } else {
                        if word.written == 0 {
                            return Err(self.fault(t, i, LAUNCH_FAILED, format!("a read of shared word {:#x}, which no thread of this block has written: on a GPU it holds whatever the SM left there", w * 4)));
                        }
                        if other_wrote {
                            let [x, y, z] = coords(word.writer, self.block);
                            return Err(self.fault(t, i, LAUNCH_FAILED, format!("a race on shared word {:#x} (read-after-write): thread ({x},{y},{z}) wrote it since the last barrier", w * 4)));
                        }
                        if word.read == bs.epoch && word.reader != local {
                            word.readers = true;
                        } else if word.read != bs.epoch {
                            word.readers = false;
                        }
                        word.reader = local;
                        word.read = bs.epoch;
                    }
                }
                let range = at as usize..end as usize;
                if store {
                    bs.shared[range].copy_from_slice(data);
                } else {
                    data.copy_from_slice(&bs.shared[range]);
                }
                Ok(())
            }
            Space::Global | Space::Generic => {
                let r = if store { mem.store(at, data) } else { mem.load(at, data, uncached) };
                r.map_err(|why| {
                    self.fault(t, i, ILLEGAL_ADDRESS, format!("global {kind} of {n} bytes at {at:#x}: {why}"))
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ptx::parse;

    /// Global memory as one flat buffer at `base`, for tests without the driver.
    pub struct Flat {
        pub base: u64,
        pub bytes: Vec<u8>,
    }

    impl Memory for Flat {
        fn load(&mut self, addr: u64, out: &mut [u8], _uncached: bool) -> Result<(), String> {
            let off = addr.checked_sub(self.base).ok_or("below the buffer")? as usize;
            let src = self.bytes.get(off..off + out.len()).ok_or("past the buffer")?;
            out.copy_from_slice(src);
            Ok(())
        }
        fn store(&mut self, addr: u64, data: &[u8]) -> Result<(), String> {
            let off = addr.checked_sub(self.base).ok_or("below the buffer")? as usize;
            let dst = self.bytes.get_mut(off..off + data.len()).ok_or("past the buffer")?;
            dst.copy_from_slice(data);
            Ok(())
        }
        fn timer_start(&self) -> u64 {
            1_000
        }
    }

    const HEAD: &str = ".version 7.0\n.target sm_70\n.address_size 64\n";

    fn launch(body: &str, grid: u32, block: u32, mem: &mut Flat) -> Result<Stats, Fault> {
        let m = parse(&format!("{HEAD}{body}")).unwrap();
        let e = m.functions.iter().position(|f| f.entry).unwrap();
        let params = mem.base.to_le_bytes();
        run(&m, e, [grid, 1, 1], [block, 1, 1], &params, mem, &Limits { max_instructions: 1_000_000 })
    }

    #[test]
    fn grid_stride_arithmetic_and_calls() {
        let body = ".func (.reg .b64 %v) twice(.reg .b64 %a)\n{\n add.u64 %v, %a, %a;\n ret;\n}\n\
            .visible .entry k(.param .u64 p)\n{\n .reg .b32 %r<3>;\n .reg .b64 %rd<5>;\n\
             ld.param.u64 %rd1, [p];\n mov.u32 %r1, %ctaid.x;\n mov.u32 %r2, %ntid.x;\n mul.wide.u32 %rd2, %r1, %r2;\n\
             mov.u32 %r1, %tid.x;\n cvt.u64.u32 %rd3, %r1;\n add.u64 %rd2, %rd2, %rd3;\n\
             call.uni (%rd4), twice, (%rd2);\n shl.b64 %rd3, %rd2, 3;\n add.u64 %rd3, %rd1, %rd3;\n\
             st.global.u64 [%rd3], %rd4;\n ret;\n}\n";
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 8 * 12] };
        launch(body, 3, 4, &mut mem).unwrap();
        let got: Vec<u64> = mem.bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, (0..12).map(|i| 2 * i).collect::<Vec<u64>>());
    }

    #[test]
    fn an_unwritten_register_is_reported_with_where() {
        let body = ".visible .entry k(.param .u64 p)\n{\n .reg .b64 %rd<3>;\n ld.param.u64 %rd1, [p];\n\
             st.global.u64 [%rd1], %rd2;\n ret;\n}\n";
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 8] };
        let f = launch(body, 1, 1, &mut mem).unwrap_err();
        assert_eq!(f.code, LAUNCH_FAILED);
        assert!(f.to_string().contains("k: block (0,0,0) thread (0,0,0), line 8 `st.global.u64 [%rd1], %rd2`: reads %rd2, which was never written"), "{f}");
    }

    #[test]
    fn misaligned_and_out_of_bounds_accesses() {
        let body = |off: i64| {
            format!(
                ".visible .entry k(.param .u64 p)\n{{\n .reg .b64 %rd<3>;\n ld.param.u64 %rd1, [p];\n\
             mov.u64 %rd2, 7;\n st.global.u64 [%rd1+{off}], %rd2;\n ret;\n}}\n"
            )
        };
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 16] };
        assert_eq!(launch(&body(4), 1, 1, &mut mem).unwrap_err().code, MISALIGNED_ADDRESS);
        let f = launch(&body(16), 1, 1, &mut mem).unwrap_err();
        assert_eq!(f.code, ILLEGAL_ADDRESS);
        assert!(f.message.contains("past the buffer"), "{f}");
        launch(&body(8), 1, 1, &mut mem).unwrap();
        assert_eq!(mem.bytes[8], 7);
    }

    /// Two threads writing one shared word between barriers; and a thread reading what another
    /// wrote without a barrier between.
    #[test]
    fn shared_races_are_caught() {
        let ww = ".visible .entry k(.param .u64 p)\n{\n .reg .b32 %r<3>;\n .shared .align 4 .b32 s[4];\n\
             mov.u32 %r1, s;\n mov.u32 %r2, 5;\n st.shared.u32 [%r1], %r2;\n ret;\n}\n";
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 8] };
        let f = launch(ww, 1, 2, &mut mem).unwrap_err();
        assert!(f.message.contains("write-after-write") && f.thread == [1, 0, 0], "{f}");
        // Each thread writes its own word, then reads its neighbour's: a race without the
        // barrier, none with it.
        let raw = |bar: &str| {
            format!(".visible .entry k(.param .u64 p)\n{{\n .reg .b32 %r<6>;\n .shared .align 4 .b32 s[4];\n\
             mov.u32 %r1, %tid.x;\n shl.b32 %r2, %r1, 2;\n mov.u32 %r3, s;\n add.u32 %r4, %r3, %r2;\n st.shared.u32 [%r4], %r1;\n{bar}\
             xor.b32 %r5, %r2, 4;\n add.u32 %r4, %r3, %r5;\n ld.shared.u32 %r5, [%r4];\n ret;\n}}\n")
        };
        let f = launch(&raw(""), 1, 2, &mut mem).unwrap_err();
        assert!(f.message.contains("read-after-write"), "{f}");
        launch(&raw(" bar.sync 0;\n"), 1, 2, &mut mem).unwrap();
    }

    /// Shared memory is not zero at a block's start: a read of a word no thread wrote is refused
    /// with where it happened, and the same word read after a barrier that follows its write is
    /// fine.
    #[test]
    fn a_shared_word_read_before_any_write_is_refused() {
        let kernel = |write_first: bool| {
            let write = if write_first { " mov.u32 %r2, 7;\n st.shared.u32 [%r1], %r2;\n bar.sync 0;\n" } else { "" };
            format!(
                ".visible .entry k(.param .u64 p)\n{{\n .reg .b32 %r<4>;\n .reg .b64 %rd<3>;\n .shared .align 4 .b32 s[4];\n\
                 mov.u32 %r1, s;\n{write} ld.shared.u32 %r3, [%r1];\n ld.param.u64 %rd1, [p];\n st.global.u32 [%rd1], %r3;\n ret;\n}}\n"
            )
        };
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 8] };
        let f = launch(&kernel(false), 1, 1, &mut mem).unwrap_err();
        assert!(f.message.contains("a read of shared word 0x0, which no thread of this block has written"), "{f}");
        assert_eq!(f.code, LAUNCH_FAILED);
        launch(&kernel(true), 1, 1, &mut mem).unwrap();
        assert_eq!(&mem.bytes[..4], &7u32.to_le_bytes());
        // And what it held before the write was no run of zeroes.
        assert!(super::garbage(64, 0).iter().filter(|b| **b == 0).count() < 8);
        assert_ne!(super::garbage(64, 0), super::garbage(64, 1), "each block its own");
    }

    #[test]
    fn a_barrier_some_threads_never_reach_hangs() {
        let body = ".visible .entry k(.param .u64 p)\n{\n .reg .pred %p<2>;\n .reg .b32 %r<2>;\n\
             mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, 0;\n @%p1 bra DONE;\n bar.sync 0;\nDONE:\n ret;\n}\n";
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 8] };
        let f = launch(body, 1, 4, &mut mem).unwrap_err();
        assert_eq!(f.code, LAUNCH_TIMEOUT);
        assert!(f.message.contains("thread (0,0,0) of its block, which has exited"), "{f}");
        // A loop that never ends is stopped by the budget.
        let spin = ".visible .entry k(.param .u64 p)\n{\nTOP:\n bra.uni TOP;\n}\n";
        assert_eq!(launch(spin, 1, 1, &mut mem).unwrap_err().code, LAUNCH_TIMEOUT);
    }

    /// `mma.sync.aligned` is the warp's: one lane that left (or a block that is not whole warps)
    /// is undefined on a GPU and a fault here; a whole warp gets A·B + C, fragment by fragment.
    #[test]
    fn mma_needs_the_whole_warp_and_computes_the_tile() {
        let kernel = |exit_lane: &str| {
            format!(
                ".visible .entry k(.param .u64 p)\n{{\n .reg .pred %p<2>;\n .reg .b32 %r<8>;\n .reg .f32 %f<5>;\n .reg .b64 %rd<4>;\n\
                 mov.u32 %r1, %tid.x;\n setp.eq.u32 %p1, %r1, {exit_lane};\n @%p1 bra DONE;\n\
                 mov.b32 %r2, 0x3F803F80;\n mov.b32 %r3, 0x3F803F80;\n mov.b32 %r4, 0x3F803F80;\n mov.b32 %r5, 0x3F803F80;\n\
                 mov.b32 %r6, 0x40004000;\n mov.b32 %r7, 0x40004000;\n\
                 mov.f32 %f1, 0f3F800000;\n mov.f32 %f2, 0f3F800000;\n mov.f32 %f3, 0f3F800000;\n mov.f32 %f4, 0f3F800000;\n\
                 mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{%f1, %f2, %f3, %f4}}, {{%r2, %r3, %r4, %r5}}, {{%r6, %r7}}, {{%f1, %f2, %f3, %f4}};\n\
                 ld.param.u64 %rd1, [p];\n mul.wide.u32 %rd2, %r1, 4;\n add.u64 %rd3, %rd1, %rd2;\n st.global.f32 [%rd3], %f4;\n\
                 DONE:\n ret;\n}}\n"
            )
        };
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 4 * 64] };
        // A all ones (BF16 0x3F80), B all twos (0x4000), C ones: every entry is 16·1·2 + 1 = 33.
        launch(&kernel("99"), 1, 64, &mut mem).unwrap();
        assert!(mem.bytes.chunks_exact(4).all(|c| f32::from_le_bytes(c.try_into().unwrap()) == 33.0));
        let f = launch(&kernel("5"), 1, 32, &mut mem).unwrap_err();
        assert_eq!(f.code, ILLEGAL_INSTRUCTION);
        assert!(f.message.contains("lane 5 of the warp has exited"), "{f}");
        let f = launch(&kernel("99"), 1, 48, &mut mem).unwrap_err();
        assert!(f.message.contains("needs a full warp of 32 threads; this one has 16"), "{f}");
    }

    #[test]
    fn integer_semantics_at_the_edges() {
        // shl by more than the width is 0 (clamped); shr.s32 fills with the sign; cvt.s64.s32
        // sign-extends; rem.u64; div by zero is reported.
        let body =
            ".visible .entry k(.param .u64 p)\n{\n .reg .b32 %r<4>;\n .reg .b64 %rd<6>;\n ld.param.u64 %rd1, [p];\n\
             mov.u32 %r1, 1;\n shl.b32 %r2, %r1, 40;\n cvt.u64.u32 %rd2, %r2;\n st.global.u64 [%rd1], %rd2;\n\
             mov.u32 %r1, -8;\n shr.s32 %r2, %r1, 1;\n cvt.s64.s32 %rd2, %r2;\n st.global.u64 [%rd1+8], %rd2;\n\
             mov.u64 %rd3, 100;\n rem.u64 %rd4, %rd3, 17;\n st.global.u64 [%rd1+16], %rd4;\n\
             mad.lo.u64 %rd4, %rd3, 3, 5;\n st.global.u64 [%rd1+24], %rd4;\n ret;\n}\n";
        let mut mem = Flat { base: 0x1000, bytes: vec![0; 32] };
        launch(body, 1, 1, &mut mem).unwrap();
        let got: Vec<u64> = mem.bytes.chunks(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, [0, (-4i64) as u64, 15, 305]);
        let div0 = ".visible .entry k(.param .u64 p)\n{\n .reg .b32 %r<3>;\n mov.u32 %r1, 0;\n div.u32 %r2, 5, %r1;\n ret;\n}\n";
        assert!(launch(div0, 1, 1, &mut mem).unwrap_err().message.contains("divides by zero"));
    }
}
