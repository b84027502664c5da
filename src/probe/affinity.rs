//! Pinned host memory near the GPU. The kernel gives a page from the NUMA node of the CPU that
//! first touches it, and `cuMemHostAlloc` touches its pages on the calling thread; a buffer
//! pinned on the far socket crosses the inter-socket link on every copy and measures that link,
//! not the GPU's PCIe path. nvbandwidth therefore sets the thread's CPU affinity to the GPU's
//! CPUs (`nvmlDeviceSetCpuAffinity`) before it allocates host memory; the probe does the same
//! from sysfs (`/sys/bus/pci/devices/<address>/local_cpulist`, the CPUs the kernel says are
//! local to the device) and puts the thread's affinity back afterwards.

use std::path::Path;

/// While alive, the calling thread runs only on the CPUs near one GPU.
pub struct Near {
    saved: Option<libc::cpu_set_t>,
    /// What was done, for the report: "NUMA node 1 (CPUs 48-95)" or why nothing was.
    pub placement: String,
}

impl Drop for Near {
    fn drop(&mut self) {
        if let Some(saved) = &self.saved {
            // SAFETY: `saved` is a cpu_set_t sched_getaffinity filled for this thread.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), saved) };
        }
    }
}

/// Pins the calling thread to the CPUs local to the PCI device `address` on this machine.
pub fn near(address: &str) -> Near {
    near_in(&Path::new("/sys/bus/pci/devices").join(address))
}

/// As `near`, for the device whose sysfs directory is `dir`. Never fails: a VM that reports no
/// locality (`numa_node` -1, the usual case in a single-node guest), an unreadable list or a
/// kernel that refuses the mask leave the thread as it was, and `placement` says why.
pub fn near_in(dir: &Path) -> Near {
    let unchanged = |why: String| Near { saved: None, placement: why };
    let node = std::fs::read_to_string(dir.join("numa_node")).ok().and_then(|s| s.trim().parse::<i64>().ok());
    if node.is_none_or(|n| n < 0) {
        return unchanged(
            "no NUMA locality reported for the GPU (numa_node -1 or absent): host memory where the kernel puts it"
                .into(),
        );
    }
    let list = match std::fs::read_to_string(dir.join("local_cpulist")) {
        Ok(s) => s.trim().to_string(),
        Err(e) => return unchanged(format!("{}: {e}", dir.join("local_cpulist").display())),
    };
    let Some(cpus) = parse_cpulist(&list) else {
        return unchanged(format!("{}: unreadable CPU list {list:?}", dir.join("local_cpulist").display()));
    };
    // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
    let mut saved: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `saved` is a writable cpu_set_t of `size` bytes.
    if unsafe { libc::sched_getaffinity(0, size, &mut saved) } != 0 {
        return unchanged(format!("sched_getaffinity: {}", std::io::Error::last_os_error()));
    }
    // Only CPUs this thread may already use (a container's cpuset stays respected).
    // SAFETY: as above.
    let mut want: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let mut n = 0;
    for &c in cpus.iter().filter(|c| **c < libc::CPU_SETSIZE as usize) {
        // SAFETY: `c` is below CPU_SETSIZE, inside both sets.
        if unsafe { libc::CPU_ISSET(c, &saved) } {
            unsafe { libc::CPU_SET(c, &mut want) };
            n += 1;
        }
    }
    if n == 0 {
        return unchanged(format!(
            "none of the GPU's CPUs ({list}) is allowed to this process: host memory where the kernel puts it"
        ));
    }
    // SAFETY: `want` is a cpu_set_t of `size` bytes.
    if unsafe { libc::sched_setaffinity(0, size, &want) } != 0 {
        return unchanged(format!("sched_setaffinity({list}): {}", std::io::Error::last_os_error()));
    }
    Near { saved: Some(saved), placement: format!("NUMA node {} (CPUs {list})", node.unwrap_or(-1)) }
}

/// `0-3,8,10-11` → [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format, cpuset(7)).
pub fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 1 << 16 {
                    return None;
                }
                out.extend(a..=b);
            }
            None => out.push(part.parse().ok()?),
        }
    }
    (!out.is_empty()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn current() -> Vec<usize> {
        // SAFETY: as in near_in.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        assert_eq!(unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
        (0..libc::CPU_SETSIZE as usize).filter(|c| unsafe { libc::CPU_ISSET(*c, &set) }).collect()
    }

    #[test]
    fn cpulists_parse_as_the_kernel_writes_them() {
        assert_eq!(parse_cpulist("0-3,8,10-11\n".trim()), Some(vec![0, 1, 2, 3, 8, 10, 11]));
        assert_eq!(parse_cpulist("5"), Some(vec![5]));
        assert_eq!(parse_cpulist(""), None);
        assert_eq!(parse_cpulist("3-1"), None);
        assert_eq!(parse_cpulist("x"), None);
    }

    /// The thread runs on the GPU's CPUs while the guard lives, and as before once it is gone.
    #[test]
    fn the_thread_is_pinned_near_the_gpu_and_let_go_after() {
        let before = current();
        let first = before[0];
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("numa_node"), "1\n").unwrap();
        std::fs::write(dir.path().join("local_cpulist"), format!("{first}\n")).unwrap();
        {
            let g = near_in(dir.path());
            assert_eq!(g.placement, format!("NUMA node 1 (CPUs {first})"));
            assert_eq!(current(), [first]);
        }
        assert_eq!(current(), before);
    }

    #[test]
    fn a_guest_without_numa_locality_is_left_alone_and_says_so() {
        let before = current();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("numa_node"), "-1\n").unwrap();
        let g = near_in(dir.path());
        assert!(g.placement.contains("numa_node -1"), "{}", g.placement);
        assert_eq!(current(), before);
    }
}
