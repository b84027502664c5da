//! What the service costs in memory at rest, and the knobs that keep it small. It must not
//! change what the service does, only where its memory comes from and when it goes back.
//!
//! A snapshot allocates for a moment (sysfs text, NVML answers on worker threads, the report,
//! and, at its first scrape, both metrics renderings and their gzip) and keeps only the published bodies. With glibc's
//! defaults, the moment's memory stays in the process: each thread that allocates may get an
//! arena of its own (up to 8 per core, mallopt(3) `M_ARENA_MAX`), the first large body freed
//! raises the mmap threshold to its size so that the next ones come from the heap instead
//! (mallopt(3) `M_MMAP_THRESHOLD`: "dynamic mmap threshold"), and free pages inside an arena
//! are returned only by `malloc_trim(3)`. So:
//!
//! 1. Two arenas, and large blocks always mmapped: set once, before any thread starts. — `tune`.
//! 2. After each snapshot, the pages it freed are given back (`malloc_trim(0)`, which since
//!    glibc 2.8 releases free pages in every arena, not only the top of the main heap), on
//!    the blocking thread that took it, never on a request's path. — `after`.
//! 3. Once the service is ready, the pages of its own program that starting touched (the
//!    command line, configuration, the first snapshot's one-time paths) are given back with
//!    madvise(2) `MADV_PAGEOUT` (Linux 5.4): they are clean copies of the file, read again from
//!    it if ever needed, and most never are. What the service then uses comes back by itself,
//!    page by page: the same mappings are marked `MADV_RANDOM` first, so a fault reads only
//!    its page instead of reading around it (madvise(2): "expect page references in random
//!    order"), and the code a snapshot runs comes back without its neighbours. — `release_startup_pages`.

/// The async runtime's worker threads. The runtime serves HTTP from bytes made once per
/// snapshot and runs the service's few loops; collecting runs on the blocking pool. Two, as
/// scripts/bench-serve.sh's nginx has two workers; one has not been measured yet.
pub const RUNTIME_WORKERS: usize = 2;

/// glibc arenas for the whole process (mallopt(3) `M_ARENA_MAX`): the NVML worker threads and
/// the blocking pool come and go, and each new thread would otherwise take an arena of its own.
const ARENA_MAX: libc::c_int = 2;

/// Blocks at least this large are mmapped and unmapped when freed (mallopt(3)
/// `M_MMAP_THRESHOLD`, whose default is this same 128 KiB but moves up as large blocks are
/// freed; setting it fixes it). The metrics renderings (about 160 KB for 8 GPUs with the
/// dcgm-exporter names) and the report are such blocks.
const MMAP_THRESHOLD: libc::c_int = 128 * 1024;

/// Rule 1. Failing to set either costs memory, not correctness, so a refusal is ignored.
pub fn tune() {
    // SAFETY: mallopt takes two integers and changes glibc's tuning; called before threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, ARENA_MAX);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Rule 2: gives back the pages a snapshot freed, then hands its result on.
pub fn after<T>(taken: T) -> T {
    // SAFETY: malloc_trim takes a size and only returns free memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    taken
}

/// Rule 3: `MADV_PAGEOUT` over the read-only mappings of this program's own file. A kernel
/// without it (before 5.4) refuses with EINVAL, which costs memory, not correctness.
pub fn release_startup_pages() {
    // The process's own memory map, not the machine's: read directly, not through a Sysroot.
    let (Ok(exe), Ok(maps)) = (std::fs::read_link("/proc/self/exe"), std::fs::read_to_string("/proc/self/maps")) else {
        return;
    };
    for (start, end) in own_read_only_mappings(&maps, &exe.to_string_lossy()) {
        // SAFETY: a whole mapping of this process, page-aligned as /proc/self/maps gives it, not
        // writable: paging it out drops clean file pages, which the kernel reads back on use.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_RANDOM);
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_PAGEOUT);
        }
    }
}

/// The `(start, end)` of each non-writable mapping of `exe` in a /proc/self/maps text
/// (proc(5): `address perms offset dev inode pathname`).
fn own_read_only_mappings(maps: &str, exe: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (range, perms) = (f.next()?, f.next()?);
            let path = f.nth(3)?;
            if path != exe || perms.contains('w') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_programs_own_read_only_mappings_are_paged_out() {
        let maps = "\
55d0a0000000-55d0a0200000 r--p 00000000 fd:01 42 /usr/bin/phq-agent
55d0a0200000-55d0a0c00000 r-xp 00200000 fd:01 42 /usr/bin/phq-agent
55d0a0c00000-55d0a0d00000 rw-p 00c00000 fd:01 42 /usr/bin/phq-agent
7f0000000000-7f0000200000 r-xp 00000000 fd:01 7 /usr/lib/x86_64-linux-gnu/libc.so.6
7f0000300000-7f0000301000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
";
        assert_eq!(
            own_read_only_mappings(maps, "/usr/bin/phq-agent"),
            vec![(0x55d0a0000000, 0x55d0a0200000), (0x55d0a0200000, 0x55d0a0c00000)]
        );
    }
}
