//! The PTX a module carries, parsed for the interpreter (`interp`): its functions, their
//! parameters, registers, shared variables, labels and instructions.
//!
//! It reads the subset of PTX the agent's kernels are written in (`src/probe/kernels.ptx`),
//! exactly and no more: a statement it does not know becomes `Op::Unsupported` with its text, and
//! a launch that could reach one is refused with CUDA_ERROR_NOT_SUPPORTED naming it — never
//! skipped. Text that is not PTX at all (an unbalanced brace, a label or register that does not
//! exist) is CUDA_ERROR_INVALID_PTX at `cuModuleLoadData`, as a JIT compile error is on a real
//! driver (DRV, cuModuleLoadData). Section names below are those of NVIDIA's "Parallel Thread
//! Execution ISA" reference (*PTX*).

use std::collections::HashMap;

/// A register's or an instruction's type (PTX, "Fundamental Types").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    Pred,
    B8,
    U8,
    S8,
    B16,
    U16,
    S16,
    B32,
    U32,
    S32,
    F32,
    B64,
    U64,
    S64,
    F64,
}

impl Ty {
    fn parse(s: &str) -> Option<Ty> {
        Some(match s {
            "pred" => Ty::Pred,
            "b8" => Ty::B8,
            "u8" => Ty::U8,
            "s8" => Ty::S8,
            "b16" => Ty::B16,
            "u16" => Ty::U16,
            "s16" => Ty::S16,
            "b32" => Ty::B32,
            "u32" => Ty::U32,
            "s32" => Ty::S32,
            "f32" => Ty::F32,
            "b64" => Ty::B64,
            "u64" => Ty::U64,
            "s64" => Ty::S64,
            "f64" => Ty::F64,
            _ => return None,
        })
    }

    /// Width in bytes (a predicate counts as one).
    pub fn bytes(self) -> usize {
        match self {
            Ty::Pred | Ty::B8 | Ty::U8 | Ty::S8 => 1,
            Ty::B16 | Ty::U16 | Ty::S16 => 2,
            Ty::B32 | Ty::U32 | Ty::S32 | Ty::F32 => 4,
            Ty::B64 | Ty::U64 | Ty::S64 | Ty::F64 => 8,
        }
    }

    pub fn bits(self) -> u32 {
        if self == Ty::Pred {
            1
        } else {
            8 * self.bytes() as u32
        }
    }

    pub fn signed(self) -> bool {
        matches!(self, Ty::S8 | Ty::S16 | Ty::S32 | Ty::S64)
    }

    pub fn float(self) -> bool {
        matches!(self, Ty::F32 | Ty::F64)
    }
}

/// A state space (PTX, "State Spaces").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    Param,
    Global,
    Shared,
    /// No space named: a generic address (PTX, "Generic Addressing"). The agent's kernels name
    /// their spaces; a generic access is read as global here, which is where every generic
    /// address they could form points.
    Generic,
}

/// A special register (PTX, "Special Registers").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Special {
    Tid(usize),
    Ntid(usize),
    Ctaid(usize),
    Nctaid(usize),
    LaneId,
    GlobalTimer,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Operand {
    Reg(u16),
    Imm(u64),
    Special(Special),
    /// The address of a shared variable (`mov.u32 %r, tile;`): its offset in the block's window.
    Shared(u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Base {
    Reg(u16),
    /// An entry's parameter, by its byte offset in the parameter buffer.
    Param(u32),
    Shared(u32),
    /// A constant address (`[4096]`): the offset alone.
    Abs,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Addr {
    pub base: Base,
    pub offset: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bin {
    Add,
    Sub,
    MulLo,
    MulHi,
    Div,
    Rem,
    And,
    Or,
    Xor,
    Shl,
    Shr,
    Min,
    Max,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Op {
    Ld {
        space: Space,
        ty: Ty,
        dst: Vec<u16>,
        addr: Addr,
        /// `.cv` or `.volatile`: the word is fetched from its memory again, never a cache.
        uncached: bool,
    },
    St {
        space: Space,
        ty: Ty,
        src: Vec<Operand>,
        addr: Addr,
    },
    AtomAdd {
        space: Space,
        ty: Ty,
        dst: u16,
        addr: Addr,
        src: Operand,
    },
    Bin {
        op: Bin,
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
    },
    /// `mul.wide`: the full 2n-bit product of two n-bit operands.
    MulWide {
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
    },
    /// `mad.lo`: the low half of a·b, plus c.
    MadLo {
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Not {
        ty: Ty,
        dst: u16,
        a: Operand,
    },
    Cvt {
        to: Ty,
        from: Ty,
        dst: u16,
        a: Operand,
    },
    Setp {
        cmp: Cmp,
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
    },
    Selp {
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
        p: Operand,
    },
    /// `fma.rn.f32` or `fma.rn.f64`: a·b + c with one rounding, to nearest even.
    Fma {
        ty: Ty,
        dst: u16,
        a: Operand,
        b: Operand,
        c: Operand,
    },
    Mov {
        ty: Ty,
        dst: u16,
        src: Operand,
    },
    Bra {
        target: usize,
    },
    Call {
        func: usize,
        rets: Vec<u16>,
        args: Vec<Operand>,
    },
    /// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`: a warp's 16 × 8 tile
    /// of D = A·B + C, each lane holding its fragments of A (four registers of two 16-bit
    /// elements), B (two) and C and D (four FP32 values each).
    Mma {
        input: Half,
        d: [u16; 4],
        a: [u16; 4],
        b: [u16; 2],
        c: [u16; 4],
    },
    Ret,
    Exit,
    BarSync,
    Unsupported,
}

/// The 16-bit floating-point format of a tensor-core instruction's A and B (PTX, "Alternate
/// Floating-Point Data Formats": `.bf16` has FP32's 8-bit exponent and 7 stored mantissa bits;
/// `.f16` is IEEE 754 binary16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

impl Half {
    /// The value of a 16-bit element, exactly (both formats widen to FP32 without rounding).
    pub fn to_f32(self, bits: u16) -> f32 {
        match self {
            Half::Bf16 => f32::from_bits(u32::from(bits) << 16),
            Half::F16 => {
                let sign = u32::from(bits >> 15) << 31;
                let exp = u32::from((bits >> 10) & 0x1f);
                let man = u32::from(bits & 0x3ff);
                let v = match (exp, man) {
                    (0, 0) => 0.0,
                    // Subnormal: man × 2^-24.
                    (0, m) => m as f32 * (2.0f32).powi(-24),
                    (31, 0) => f32::INFINITY,
                    (31, _) => f32::NAN,
                    (e, m) => f32::from_bits(((e + 127 - 15) << 23) | (m << 13)),
                };
                f32::from_bits(v.to_bits() | sign)
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Instr {
    /// A guard predicate register, and whether it is negated (`@!%p`).
    pub guard: Option<(u16, bool)>,
    pub op: Op,
    /// The statement as written, and its line: what a fault names.
    pub text: String,
    pub line: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RegInfo {
    pub name: String,
    pub ty: Ty,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Param {
    pub name: String,
    pub ty: Ty,
    /// Byte offset in the parameter buffer (entries only).
    pub offset: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Function {
    pub name: String,
    pub entry: bool,
    pub regs: Vec<RegInfo>,
    /// Entries: `.param` space parameters. Functions: the registers their arguments land in.
    pub params: Vec<Param>,
    pub param_regs: Vec<u16>,
    pub ret_regs: Vec<u16>,
    pub code: Vec<Instr>,
    /// Shared variables declared in this function: (name, offset, bytes).
    pub shared: Vec<(String, u32, u32)>,
    pub shared_bytes: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Module {
    pub functions: Vec<Function>,
}

impl Module {
    pub fn function(&self, name: &str) -> Option<usize> {
        self.functions.iter().position(|f| f.name == name)
    }

    pub fn entries(&self) -> Vec<String> {
        self.functions.iter().filter(|f| f.entry).map(|f| f.name.clone()).collect()
    }

    /// The first unsupported statement an entry (or any function it calls) holds.
    pub fn unsupported_in(&self, entry: usize) -> Option<&Instr> {
        let mut seen = vec![false; self.functions.len()];
        let mut todo = vec![entry];
        while let Some(f) = todo.pop() {
            if std::mem::replace(&mut seen[f], true) {
                continue;
            }
            for i in &self.functions[f].code {
                match &i.op {
                    Op::Unsupported => return Some(i),
                    Op::Call { func, .. } => todo.push(*func),
                    _ => {}
                }
            }
        }
        None
    }
}

/// Why a text is not a module this parser can read.
#[derive(Debug, Clone, PartialEq)]
pub struct ParseError {
    pub line: usize,
    pub message: String,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

fn err<T>(line: usize, message: impl Into<String>) -> Result<T, ParseError> {
    Err(ParseError { line, message: message.into() })
}

/// The text with comments blanked out (PTX, "Comments": `//` to the end of the line, and
/// `/* … */`), line breaks kept so line numbers stay right.
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let b = text.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i < b.len() && !(b[i] == b'*' && b.get(i + 1) == Some(&b'/')) {
                out.push(if b[i] == b'\n' { '\n' } else { ' ' });
                i += 1;
            }
            i += 2;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn line_at(text: &str, pos: usize) -> usize {
    text[..pos.min(text.len())].matches('\n').count() + 1
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '$' || c == '%' || c == '.'
}

/// Parses a module. Function bodies are read after every header, so a call may name a function
/// defined later.
pub fn parse(source: &str) -> Result<Module, ParseError> {
    if !source.is_ascii() {
        return err(1, "PTX is ASCII text");
    }
    let text = strip_comments(source);
    let mut versioned = false;
    let mut headers: Vec<(Function, usize, usize)> = Vec::new(); // (header, body start, body end)
    let mut pos = 0;
    let bytes = text.as_bytes();
    while pos < text.len() {
        let rest = &text[pos..];
        let trimmed = rest.trim_start();
        if trimmed.is_empty() {
            break;
        }
        pos += rest.len() - trimmed.len();
        let line = line_at(&text, pos);
        let word: String = trimmed.chars().take_while(|c| is_ident(*c)).collect();
        match word.as_str() {
            ".version" | ".target" | ".address_size" => {
                let end = trimmed.find('\n').unwrap_or(trimmed.len());
                versioned |= word == ".version";
                pos += end;
            }
            ".visible" | ".weak" | ".entry" | ".func" => {
                let Some(open) = trimmed.find('{') else { return err(line, format!("{word} without a body")) };
                let header = &trimmed[..open];
                // The body: up to the matching brace.
                let start = pos + open + 1;
                let mut depth = 1;
                let mut i = start;
                while i < bytes.len() && depth > 0 {
                    match bytes[i] {
                        b'{' => depth += 1,
                        b'}' => depth -= 1,
                        _ => {}
                    }
                    i += 1;
                }
                if depth != 0 {
                    return err(line, "a function body without its closing brace");
                }
                headers.push((parse_header(header, line)?, start, i - 1));
                pos = i;
            }
            "" => return err(line, format!("unexpected {:?}", trimmed.chars().next().unwrap_or(' '))),
            other => {
                return err(
                    line,
                    format!("the module-level directive {other} is not read by the fake's PTX interpreter"),
                )
            }
        }
    }
    if !versioned {
        return err(1, "no .version directive");
    }
    let names: HashMap<String, usize> = headers.iter().enumerate().map(|(i, (f, _, _))| (f.name.clone(), i)).collect();
    let mut functions = Vec::new();
    for (mut f, start, end) in headers {
        parse_body(&mut f, &text, start, end, &names)?;
        functions.push(f);
    }
    // A call's arguments and results must match the callee's signature.
    for f in &functions {
        for i in &f.code {
            if let Op::Call { func, rets, args } = &i.op {
                let callee = &functions[*func];
                if rets.len() != callee.ret_regs.len() || args.len() != callee.param_regs.len() {
                    return err(
                        i.line,
                        format!(
                            "{}: {} takes {} argument(s) and returns {}",
                            i.text,
                            callee.name,
                            callee.param_regs.len(),
                            callee.ret_regs.len()
                        ),
                    );
                }
            }
        }
    }
    Ok(Module { functions })
}

/// `.visible .entry name(.param .u64 a, …)` or `.func (.reg .b64 r) name(.reg .b64 a, …)`.
fn parse_header(h: &str, line: usize) -> Result<Function, ParseError> {
    let words: Vec<&str> = h.split_whitespace().collect();
    let entry = words.contains(&".entry");
    let kind = if entry { ".entry" } else { ".func" };
    let Some(at) = h.find(kind) else { return err(line, "neither .entry nor .func") };
    let mut rest: String = h[at + kind.len()..].trim().to_string();
    let mut f = Function {
        name: String::new(),
        entry,
        regs: Vec::new(),
        params: Vec::new(),
        param_regs: Vec::new(),
        ret_regs: Vec::new(),
        code: Vec::new(),
        shared: Vec::new(),
        shared_bytes: 0,
    };
    let take_list = |s: &str| -> Result<(String, String), ParseError> {
        let Some(close) = s.find(')') else { return err(line, "an unclosed parameter list") };
        Ok((s[1..close].to_string(), s[close + 1..].trim().to_string()))
    };
    if !entry && rest.starts_with('(') {
        let (list, after) = take_list(&rest)?;
        for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (ty, name) = reg_param(p, line)?;
            let r = add_reg(&mut f, &name, ty, line)?;
            f.ret_regs.push(r);
        }
        rest = after;
    }
    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_' || *c == '$').collect();
    if name.is_empty() {
        return err(line, "a function without a name");
    }
    f.name = name.clone();
    let after_name = rest[name.len()..].trim();
    if after_name.starts_with('(') {
        let (list, _) = take_list(after_name)?;
        let mut offset = 0u32;
        for p in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            if entry {
                // `.param .u64 name`: laid out in order, each at its natural alignment (PTX,
                // "Kernel Function Parameters"; cuLaunchKernel copies each from its pointer).
                let w: Vec<&str> = p.split_whitespace().collect();
                let (ty, pname) = match w.as_slice() {
                    [".param", t, n] => (t.strip_prefix('.').and_then(Ty::parse), *n),
                    _ => (None, ""),
                };
                let Some(ty) = ty.filter(|t| *t != Ty::Pred) else {
                    return err(line, format!("the parameter {p:?} is not a plain .param scalar"));
                };
                let size = ty.bytes() as u32;
                offset = offset.div_ceil(size) * size;
                f.params.push(Param { name: pname.to_string(), ty, offset });
                offset += size;
            } else {
                let (ty, pname) = reg_param(p, line)?;
                let r = add_reg(&mut f, &pname, ty, line)?;
                f.param_regs.push(r);
            }
        }
    }
    Ok(f)
}

/// `.reg .b64 %a` in a `.func` signature.
fn reg_param(p: &str, line: usize) -> Result<(Ty, String), ParseError> {
    let w: Vec<&str> = p.split_whitespace().collect();
    match w.as_slice() {
        [".reg", t, n] => match t.strip_prefix('.').and_then(Ty::parse) {
            Some(ty) => Ok((ty, n.to_string())),
            None => err(line, format!("unknown type in {p:?}")),
        },
        _ => err(line, format!("the .func parameter {p:?} is not a .reg parameter")),
    }
}

fn add_reg(f: &mut Function, name: &str, ty: Ty, line: usize) -> Result<u16, ParseError> {
    if f.regs.iter().any(|r| r.name == name) {
        return err(line, format!("register {name} declared twice"));
    }
    let i = u16::try_from(f.regs.len()).or_else(|_| err(line, "too many registers"))?;
    f.regs.push(RegInfo { name: name.to_string(), ty });
    Ok(i)
}

/// One statement of a body, before its names are resolved.
struct Raw {
    line: usize,
    text: String,
}

fn parse_body(
    f: &mut Function,
    text: &str,
    start: usize,
    end: usize,
    funcs: &HashMap<String, usize>,
) -> Result<(), ParseError> {
    let body = &text[start..end];
    let mut statements: Vec<Raw> = Vec::new();
    let mut labels: HashMap<String, usize> = HashMap::new();
    let mut cur = String::new();
    let mut cur_start = start;
    for (i, c) in body.char_indices() {
        if c == ';' {
            let line = line_at(text, cur_start + (cur.len() - cur.trim_start().len()));
            let mut s = cur.trim().to_string();
            // Labels before the instruction: `NAME:`.
            while let Some(colon) = s.find(':') {
                let head = &s[..colon];
                if head.is_empty() || !head.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
                    break;
                }
                labels.insert(head.to_string(), statements.len());
                s = s[colon + 1..].trim().to_string();
            }
            if !s.is_empty() {
                statements.push(Raw { line, text: s });
            }
            cur.clear();
            cur_start = start + i + 1;
        } else {
            cur.push(c);
        }
    }
    // Labels after the last statement.
    let mut tail = cur.trim().to_string();
    while let Some(colon) = tail.find(':') {
        let head = tail[..colon].to_string();
        if head.is_empty() || !head.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return err(line_at(text, end), format!("{tail:?} is not a statement (no ';')"));
        }
        labels.insert(head, statements.len());
        tail = tail[colon + 1..].trim().to_string();
    }
    if !tail.is_empty() {
        return err(line_at(text, end), format!("{tail:?} is not a statement (no ';')"));
    }
    // Declarations first (registers and shared variables may be declared anywhere in the body,
    // before use), then instructions.
    let mut code_raw = Vec::new();
    let mut label_fix: HashMap<usize, usize> = HashMap::new(); // statement index -> instruction index
    for (si, st) in statements.iter().enumerate() {
        label_fix.insert(si, code_raw.len());
        let first = st.text.split_whitespace().next().unwrap_or("");
        match first {
            ".reg" => declare_regs(f, &st.text, st.line)?,
            ".shared" => declare_shared(f, &st.text, st.line)?,
            _ => code_raw.push(st),
        }
    }
    label_fix.insert(statements.len(), code_raw.len());
    let labels: HashMap<String, usize> = labels.into_iter().map(|(k, v)| (k, label_fix[&v])).collect();
    let reg_index: HashMap<String, u16> = f.regs.iter().enumerate().map(|(i, r)| (r.name.clone(), i as u16)).collect();
    let cx = Cx { f, reg_index: &reg_index, labels: &labels, funcs };
    let mut code = Vec::new();
    for st in code_raw {
        code.push(cx.instr(st)?);
    }
    f.code = code;
    Ok(())
}

/// `.reg .b32 %r<6>;` or `.reg .f32 %f1, %f2;`
fn declare_regs(f: &mut Function, s: &str, line: usize) -> Result<(), ParseError> {
    let rest = s.trim_start_matches(".reg").trim();
    let (t, names) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    let Some(ty) = t.strip_prefix('.').and_then(Ty::parse) else {
        return err(line, format!("{s}: unknown register type"));
    };
    for n in names.split(',').map(str::trim).filter(|n| !n.is_empty()) {
        if let Some((prefix, count)) = n.split_once('<') {
            let count: u32 = count.trim_end_matches('>').parse().or_else(|_| err(line, format!("{n}: a bad count")))?;
            for k in 0..count {
                add_reg(f, &format!("{prefix}{k}"), ty, line)?;
            }
        } else {
            add_reg(f, n, ty, line)?;
        }
    }
    Ok(())
}

/// `.shared .align 4 .f32 tile_a[256];`
fn declare_shared(f: &mut Function, s: &str, line: usize) -> Result<(), ParseError> {
    let words: Vec<&str> = s.split_whitespace().collect();
    let mut align = 1u32;
    let mut ty = None;
    let mut decl = None;
    let mut i = 1;
    while i < words.len() {
        match words[i] {
            ".align" => {
                align = words
                    .get(i + 1)
                    .and_then(|a| a.parse().ok())
                    .ok_or(ParseError { line, message: format!("{s}: a bad .align") })?;
                i += 2;
                continue;
            }
            w if w.starts_with('.') => ty = Ty::parse(&w[1..]),
            w => decl = Some(w),
        }
        i += 1;
    }
    let (Some(ty), Some(decl)) = (ty, decl) else {
        return err(line, format!("{s}: not a shared variable the interpreter reads"));
    };
    let (name, count) = match decl.split_once('[') {
        Some((n, c)) => {
            (n, c.trim_end_matches(']').parse::<u32>().or_else(|_| err(line, format!("{s}: a bad array size")))?)
        }
        None => (decl, 1),
    };
    let align = align.max(ty.bytes() as u32);
    let offset = f.shared_bytes.div_ceil(align) * align;
    let bytes = ty.bytes() as u32 * count;
    f.shared.push((name.to_string(), offset, bytes));
    f.shared_bytes = offset + bytes;
    Ok(())
}

struct Cx<'a> {
    f: &'a Function,
    reg_index: &'a HashMap<String, u16>,
    labels: &'a HashMap<String, usize>,
    funcs: &'a HashMap<String, usize>,
}

/// Splits operands at top-level commas (not inside `{}`, `[]` or `()`).
fn split_operands(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '{' | '[' | '(' => depth += 1,
            '}' | ']' | ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(cur.trim().to_string());
                cur.clear();
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    if !cur.trim().is_empty() {
        out.push(cur.trim().to_string());
    }
    out
}

/// An integer or floating-point literal (PTX ISA, "Integer Constants" and "Floating-Point
/// Constants"): as in C, decimal (a nonzero first digit), `0x` hex, `0b` binary and octal (a
/// leading `0`: `0123` is 83, and `08` is no literal at all), a `U` suffix, a leading `-`;
/// `0fXXXXXXXX` is the bits of an f32, `0dXXXXXXXXXXXXXXXX` of an f64.
fn literal(s: &str) -> Option<u64> {
    let s = s.trim();
    if let Some(h) = s.strip_prefix("0f").or_else(|| s.strip_prefix("0F")) {
        return (h.len() == 8).then(|| u32::from_str_radix(h, 16).ok().map(u64::from)).flatten();
    }
    if let Some(h) = s.strip_prefix("0d").or_else(|| s.strip_prefix("0D")) {
        return (h.len() == 16).then(|| u64::from_str_radix(h, 16).ok()).flatten();
    }
    let (neg, body) = match s.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, s),
    };
    let body = body.trim_end_matches('U');
    let v = if let Some(h) = body.strip_prefix("0x").or_else(|| body.strip_prefix("0X")) {
        u64::from_str_radix(h, 16).ok()?
    } else if let Some(b) = body.strip_prefix("0b").or_else(|| body.strip_prefix("0B")) {
        u64::from_str_radix(b, 2).ok()?
    } else if let Some(o) = body.strip_prefix('0').filter(|o| !o.is_empty()) {
        u64::from_str_radix(o, 8).ok()?
    } else if body.chars().all(|c| c.is_ascii_digit()) && !body.is_empty() {
        body.parse::<u64>().ok()?
    } else {
        return None;
    };
    Some(if neg { v.wrapping_neg() } else { v })
}

fn special(s: &str) -> Option<Special> {
    let dim = |d: &str| match d {
        "x" => Some(0),
        "y" => Some(1),
        "z" => Some(2),
        _ => None,
    };
    if s == "%globaltimer" {
        return Some(Special::GlobalTimer);
    }
    if s == "%laneid" {
        return Some(Special::LaneId);
    }
    let (name, d) = s.split_once('.')?;
    let d = dim(d)?;
    Some(match name {
        "%tid" => Special::Tid(d),
        "%ntid" => Special::Ntid(d),
        "%ctaid" => Special::Ctaid(d),
        "%nctaid" => Special::Nctaid(d),
        _ => return None,
    })
}

impl Cx<'_> {
    fn reg(&self, s: &str, line: usize) -> Result<u16, ParseError> {
        self.reg_index
            .get(s.trim())
            .copied()
            .ok_or(ParseError { line, message: format!("register {s} is not declared") })
    }

    fn operand(&self, s: &str, line: usize) -> Result<Operand, ParseError> {
        let s = s.trim();
        if let Some(sp) = special(s) {
            return Ok(Operand::Special(sp));
        }
        if s.starts_with('%') {
            return self.reg(s, line).map(Operand::Reg);
        }
        if let Some(v) = literal(s) {
            return Ok(Operand::Imm(v));
        }
        if let Some((_, off, _)) = self.f.shared.iter().find(|(n, _, _)| n == s) {
            return Ok(Operand::Shared(*off));
        }
        err(line, format!("{s:?} is not a register, a constant or a shared variable"))
    }

    fn addr(&self, s: &str, line: usize) -> Result<Addr, ParseError> {
        let inner = s.trim().strip_prefix('[').and_then(|x| x.strip_suffix(']'));
        let Some(inner) = inner else { return err(line, format!("{s:?} is not an address [..]")) };
        let inner = inner.replace(' ', "");
        let (base, offset) = match inner.find(['+', '-']).filter(|i| *i > 0) {
            Some(i) => {
                let off = literal(inner[i..].trim_start_matches('+'))
                    .ok_or(ParseError { line, message: format!("{s}: a bad offset") })?;
                (&inner[..i], off as i64)
            }
            None => (inner.as_str(), 0),
        };
        let base = if base.starts_with('%') {
            Base::Reg(self.reg(base, line)?)
        } else if let Some(p) = self.f.params.iter().find(|p| p.name == base) {
            Base::Param(p.offset)
        } else if let Some((_, off, _)) = self.f.shared.iter().find(|(n, _, _)| n == base) {
            Base::Shared(*off)
        } else if let Some(v) = literal(base) {
            return Ok(Addr { base: Base::Abs, offset: v as i64 + offset });
        } else {
            return err(line, format!("{s}: {base} is no register, parameter or shared variable"));
        };
        Ok(Addr { base, offset })
    }

    fn regs_of(&self, s: &str, line: usize) -> Result<Vec<u16>, ParseError> {
        match s.trim().strip_prefix('{').and_then(|x| x.strip_suffix('}')) {
            Some(inner) => inner.split(',').map(|r| self.reg(r, line)).collect(),
            None => Ok(vec![self.reg(s, line)?]),
        }
    }

    fn operands_of(&self, s: &str, line: usize) -> Result<Vec<Operand>, ParseError> {
        match s.trim().strip_prefix('{').and_then(|x| x.strip_suffix('}')) {
            Some(inner) => inner.split(',').map(|r| self.operand(r, line)).collect(),
            None => Ok(vec![self.operand(s, line)?]),
        }
    }

    fn instr(&self, raw: &Raw) -> Result<Instr, ParseError> {
        let line = raw.line;
        let mut s = raw.text.as_str();
        let mut guard = None;
        if let Some(g) = s.strip_prefix('@') {
            let (p, rest) = g
                .split_once(char::is_whitespace)
                .ok_or(ParseError { line, message: format!("{s}: a guard without an instruction") })?;
            let (neg, p) = match p.strip_prefix('!') {
                Some(p) => (true, p),
                None => (false, p),
            };
            let r = self.reg(p, line)?;
            if self.f.regs[r as usize].ty != Ty::Pred {
                return err(line, format!("{s}: the guard {p} is not a predicate"));
            }
            guard = Some((r, neg));
            s = rest.trim();
        }
        let (opcode, rest) = s.split_once(char::is_whitespace).unwrap_or((s, ""));
        let ops = split_operands(rest);
        let parts: Vec<&str> = opcode.split('.').collect();
        let base = parts[0];
        let mods = &parts[1..];
        let ty_of = |m: &[&str]| m.iter().rev().find_map(|x| Ty::parse(x));
        let has = |m: &str| mods.contains(&m);
        let want = |n: usize| -> Result<(), ParseError> {
            if ops.len() == n {
                Ok(())
            } else {
                err(line, format!("{s}: {base} takes {n} operands"))
            }
        };
        let space = || {
            if has("param") {
                Space::Param
            } else if has("global") {
                Space::Global
            } else if has("shared") {
                Space::Shared
            } else {
                Space::Generic
            }
        };
        let unsupported = Instr { guard, op: Op::Unsupported, text: raw.text.clone(), line };
        let known_mods = |allowed: &[&str]| mods.iter().all(|m| allowed.contains(m) || Ty::parse(m).is_some());
        let op = match base {
            // PTX, "Data Movement and Conversion Instructions: ld, st": the cache operators
            // (.ca .cg .cs .lu .cv; .wb .wt) are hints that change no value; `.volatile` keeps an
            // access from being merged with another. Vectors .v2/.v4 move that many elements.
            "ld" | "st" => {
                if !known_mods(&[
                    "param", "global", "shared", "volatile", "ca", "cg", "cs", "lu", "cv", "wb", "wt", "v2", "v4",
                ]) {
                    return Ok(unsupported);
                }
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                want(2)?;
                if base == "ld" {
                    let dst = self.regs_of(&ops[0], line)?;
                    let n = if has("v4") {
                        4
                    } else if has("v2") {
                        2
                    } else {
                        1
                    };
                    if dst.len() != n {
                        return err(line, format!("{s}: {n} destination register(s) expected"));
                    }
                    Op::Ld {
                        space: space(),
                        ty,
                        dst,
                        addr: self.addr(&ops[1], line)?,
                        uncached: has("cv") || has("volatile"),
                    }
                } else {
                    let src = self.operands_of(&ops[1], line)?;
                    let n = if has("v4") {
                        4
                    } else if has("v2") {
                        2
                    } else {
                        1
                    };
                    if src.len() != n {
                        return err(line, format!("{s}: {n} source operand(s) expected"));
                    }
                    if space() == Space::Param {
                        return Ok(unsupported);
                    }
                    Op::St { space: space(), ty, src, addr: self.addr(&ops[0], line)? }
                }
            }
            // PTX, "Parallel Synchronization and Communication Instructions: atom": an atomic
            // read-modify-write; `add` of an integer type, the old value returned.
            "atom" => {
                if !known_mods(&["global", "shared", "add", "relaxed", "gpu"]) || !has("add") {
                    return Ok(unsupported);
                }
                let Some(ty) = ty_of(mods).filter(|t| !t.float()) else { return Ok(unsupported) };
                want(3)?;
                Op::AtomAdd {
                    space: space(),
                    ty,
                    dst: self.reg(&ops[0], line)?,
                    addr: self.addr(&ops[1], line)?,
                    src: self.operand(&ops[2], line)?,
                }
            }
            // PTX, "Integer Arithmetic Instructions" and "Logic and Shift Instructions".
            "add" | "sub" | "div" | "rem" | "and" | "or" | "xor" | "shl" | "shr" | "min" | "max" | "mul" => {
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                if ty.float() || mods.iter().any(|m| ["sat", "cc", "rn", "rz", "ftz", "approx", "full"].contains(m)) {
                    return Ok(unsupported);
                }
                want(3)?;
                let (dst, a, b) =
                    (self.reg(&ops[0], line)?, self.operand(&ops[1], line)?, self.operand(&ops[2], line)?);
                if base == "mul" {
                    if has("wide") {
                        if ty.bytes() > 4 {
                            return Ok(unsupported);
                        }
                        Op::MulWide { ty, dst, a, b }
                    } else if has("hi") {
                        Op::Bin { op: Bin::MulHi, ty, dst, a, b }
                    } else if has("lo") {
                        Op::Bin { op: Bin::MulLo, ty, dst, a, b }
                    } else {
                        return Ok(unsupported);
                    }
                } else {
                    let op = match base {
                        "add" => Bin::Add,
                        "sub" => Bin::Sub,
                        "div" => Bin::Div,
                        "rem" => Bin::Rem,
                        "and" => Bin::And,
                        "or" => Bin::Or,
                        "xor" => Bin::Xor,
                        "shl" => Bin::Shl,
                        "shr" => Bin::Shr,
                        "min" => Bin::Min,
                        _ => Bin::Max,
                    };
                    Op::Bin { op, ty, dst, a, b }
                }
            }
            "mad" => {
                let Some(ty) = ty_of(mods).filter(|t| !t.float()) else { return Ok(unsupported) };
                if !has("lo") {
                    return Ok(unsupported);
                }
                want(4)?;
                Op::MadLo {
                    ty,
                    dst: self.reg(&ops[0], line)?,
                    a: self.operand(&ops[1], line)?,
                    b: self.operand(&ops[2], line)?,
                    c: self.operand(&ops[3], line)?,
                }
            }
            "not" => {
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                want(2)?;
                Op::Not { ty, dst: self.reg(&ops[0], line)?, a: self.operand(&ops[1], line)? }
            }
            // PTX, "cvt": integer to integer only (a float conversion names a rounding, which the
            // agent's kernels never need).
            "cvt" => {
                let tys: Vec<Ty> = mods.iter().filter_map(|m| Ty::parse(m)).collect();
                let [to, from] = tys.as_slice() else { return Ok(unsupported) };
                if to.float() || from.float() || mods.len() != 2 {
                    return Ok(unsupported);
                }
                want(2)?;
                Op::Cvt { to: *to, from: *from, dst: self.reg(&ops[0], line)?, a: self.operand(&ops[1], line)? }
            }
            // PTX, "Comparison and Selection Instructions: setp, selp".
            "setp" => {
                let cmp = match mods.first().copied() {
                    Some("eq") => Cmp::Eq,
                    Some("ne") => Cmp::Ne,
                    Some("lt") | Some("lo") => Cmp::Lt,
                    Some("le") | Some("ls") => Cmp::Le,
                    Some("gt") | Some("hi") => Cmp::Gt,
                    Some("ge") | Some("hs") => Cmp::Ge,
                    _ => return Ok(unsupported),
                };
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                if mods.len() != 2 || ops.len() != 3 || ops[0].contains('|') {
                    return Ok(unsupported);
                }
                Op::Setp {
                    cmp,
                    ty,
                    dst: self.reg(&ops[0], line)?,
                    a: self.operand(&ops[1], line)?,
                    b: self.operand(&ops[2], line)?,
                }
            }
            "selp" => {
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                want(4)?;
                Op::Selp {
                    ty,
                    dst: self.reg(&ops[0], line)?,
                    a: self.operand(&ops[1], line)?,
                    b: self.operand(&ops[2], line)?,
                    p: self.operand(&ops[3], line)?,
                }
            }
            // PTX, "Floating-Point Instructions: fma": `fma.rn.f32` and `fma.rn.f64` compute
            // a·b + c at infinite precision and round once, to nearest even — what Rust's
            // `f32::mul_add` and `f64::mul_add` do.
            "fma" => {
                let ty = match mods {
                    ["rn", "f32"] => Ty::F32,
                    ["rn", "f64"] => Ty::F64,
                    _ => return Ok(unsupported),
                };
                want(4)?;
                Op::Fma {
                    ty,
                    dst: self.reg(&ops[0], line)?,
                    a: self.operand(&ops[1], line)?,
                    b: self.operand(&ops[2], line)?,
                    c: self.operand(&ops[3], line)?,
                }
            }
            "mov" => {
                let Some(ty) = ty_of(mods) else { return Ok(unsupported) };
                want(2)?;
                Op::Mov { ty, dst: self.reg(&ops[0], line)?, src: self.operand(&ops[1], line)? }
            }
            // PTX, "Control Flow Instructions: bra, call, ret, exit"; `.uni` asserts the branch is
            // not divergent, which changes nothing here.
            "bra" => {
                if !mods.iter().all(|m| *m == "uni") {
                    return Ok(unsupported);
                }
                want(1)?;
                let target = *self
                    .labels
                    .get(ops[0].trim())
                    .ok_or(ParseError { line, message: format!("{s}: no label {}", ops[0]) })?;
                Op::Bra { target }
            }
            "call" => {
                if !mods.iter().all(|m| *m == "uni") {
                    return Ok(unsupported);
                }
                // call (rets), name, (args);  or  call name, (args);  or  call name;
                let (rets, name, args) = match ops.as_slice() {
                    [r, n, a] if r.starts_with('(') => (r.as_str(), n.as_str(), a.as_str()),
                    [n, a] => ("()", n.as_str(), a.as_str()),
                    [n] => ("()", n.as_str(), "()"),
                    _ => return err(line, format!("{s}: a call this interpreter does not read")),
                };
                let list = |x: &str| -> Vec<String> {
                    x.trim()
                        .trim_start_matches('(')
                        .trim_end_matches(')')
                        .split(',')
                        .map(|p| p.trim().to_string())
                        .filter(|p| !p.is_empty())
                        .collect()
                };
                let func = *self
                    .funcs
                    .get(name.trim())
                    .ok_or(ParseError { line, message: format!("{s}: no function {name}") })?;
                let rets = list(rets).iter().map(|r| self.reg(r, line)).collect::<Result<_, _>>()?;
                let args = list(args).iter().map(|a| self.operand(a, line)).collect::<Result<_, _>>()?;
                Op::Call { func, rets, args }
            }
            // PTX, "Warp-level Matrix Multiply-Accumulate Instructions: mma": only the shape and
            // types the agent's tensor kernel uses; `.sync.aligned` — every thread of the warp
            // executes the same mma (the interpreter holds the warp until all have arrived).
            "mma" => {
                let input = match mods {
                    ["sync", "aligned", "m16n8k16", "row", "col", "f32", "bf16", "bf16", "f32"] => Half::Bf16,
                    ["sync", "aligned", "m16n8k16", "row", "col", "f32", "f16", "f16", "f32"] => Half::F16,
                    _ => return Ok(unsupported),
                };
                want(4)?;
                let regs = |k: usize, n: usize, ty: Ty| -> Result<Vec<u16>, ParseError> {
                    let r = self.regs_of(&ops[k], line)?;
                    if r.len() != n {
                        return err(line, format!("{s}: operand {} holds {n} registers", k + 1));
                    }
                    if let Some(bad) = r.iter().find(|x| self.f.regs[**x as usize].ty.bytes() != ty.bytes()) {
                        return err(
                            line,
                            format!("{s}: {} is not a {}-byte register", self.f.regs[*bad as usize].name, ty.bytes()),
                        );
                    }
                    Ok(r)
                };
                let (d, a, b, c) =
                    (regs(0, 4, Ty::F32)?, regs(1, 4, Ty::B32)?, regs(2, 2, Ty::B32)?, regs(3, 4, Ty::F32)?);
                Op::Mma {
                    input,
                    d: [d[0], d[1], d[2], d[3]],
                    a: [a[0], a[1], a[2], a[3]],
                    b: [b[0], b[1]],
                    c: [c[0], c[1], c[2], c[3]],
                }
            }
            "ret" => Op::Ret,
            "exit" => Op::Exit,
            // PTX, "bar.sync": every thread of the block waits until all have arrived; only
            // barrier 0 with no thread count is read here.
            "bar" | "barrier" => {
                if mods != ["sync"] || ops.len() != 1 || literal(&ops[0]) != Some(0) {
                    return Ok(unsupported);
                }
                Op::BarSync
            }
            _ => return Ok(unsupported),
        };
        Ok(Instr { guard, op, text: raw.text.clone(), line })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_agents_module() {
        let m = parse(include_str!("../../../src/probe/kernels.ptx")).unwrap();
        let entries = m.entries();
        for k in
            ["phq_mem_write", "phq_mem_check", "phq_copy_sm", "phq_spin", "phq_chase", "phq_sgemm", "phq_gemm_check"]
        {
            assert!(entries.contains(&k.to_string()), "{k}: {entries:?}");
            let e = m.function(k).unwrap();
            assert!(m.unsupported_in(e).is_none(), "{k}: {:?}", m.unsupported_in(e));
        }
        let sgemm = &m.functions[m.function("phq_sgemm").unwrap()];
        assert_eq!(sgemm.shared, vec![("tile_a".to_string(), 0, 1024), ("tile_b".to_string(), 1024, 1024)]);
        let check = &m.functions[m.function("phq_mem_check").unwrap()];
        // u64 u64 u32 u64 u32 u64 u32 u64: natural alignment.
        let offsets: Vec<u32> = check.params.iter().map(|p| p.offset).collect();
        assert_eq!(offsets, [0, 8, 16, 24, 32, 40, 48, 56]);
    }

    #[test]
    fn literals_and_errors() {
        assert_eq!(literal("-7046029254386353131"), Some(0x9E3779B97F4A7C15));
        assert_eq!(literal("0f3F800000"), Some(0x3F80_0000));
        assert_eq!(literal("0x10"), Some(16));
        assert_eq!(literal("-1"), Some(u64::MAX));
        // As in C: a leading 0 is octal, 0b binary; a plain 0 is zero; 8 and 9 are no octal digits.
        assert_eq!(literal("0123"), Some(83));
        assert_eq!(literal("0123U"), Some(83));
        assert_eq!(literal("0b101"), Some(5));
        assert_eq!(literal("0"), Some(0));
        assert_eq!(literal("089"), None);
        let e = parse(".version 7.0\n.target sm_70\n.address_size 64\n.visible .entry k()\n{\n bra NOWHERE;\n}\n")
            .unwrap_err();
        assert!(e.message.contains("no label NOWHERE") && e.line == 6, "{e}");
        let e =
            parse(".version 7.0\n.visible .entry k()\n{\n .reg .b32 %r<2>;\n add.u32 %r2, %r0, 1;\n}\n").unwrap_err();
        assert!(e.message.contains("register %r2 is not declared"), "{e}");
        // Unknown instructions are kept, to be refused by name at launch.
        let m =
            parse(".version 7.0\n.visible .entry k()\n{\n .reg .b32 %r<2>;\n popc.b32 %r1, %r0;\n ret;\n}\n").unwrap();
        assert_eq!(m.unsupported_in(0).unwrap().text, "popc.b32 %r1, %r0");
    }
}
