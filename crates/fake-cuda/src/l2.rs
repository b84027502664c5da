//! Each GPU's L2: what a kernel reads comes from the cache, not from the memory's cells, while
//! the line is still there. Hopper's L2 is a write-back cache of 50 MB on the H100 (NVIDIA H100
//! Tensor Core GPU Architecture whitepaper, "H100 L2 cache"): a line written by a kernel stays
//! dirty in it, holding what was written, until something else takes its place; only then is it
//! written to HBM, and only then does a faulty cell get the chance to change it. The `.cg` and
//! `.cv` load qualifiers do not go around it for device memory — `.cg` caches "in L2, not L1",
//! `.cv` refetches only system memory (PTX ISA, "Cache Operators").
//!
//! The model is a list of the extents the GPU's work touched, newest last, each with the bytes
//! of traffic it made and whether it wrote. A byte is in the cache while less than the cache's
//! size of traffic came after its last touch (least recently used, counted in bytes); a byte
//! written and still in the cache reads what was written, whatever its cell holds. Kernels are
//! entered at their end as one extent in their walking order (the model kernels) or in the
//! order their stores and loads ran (the interpreter); a load inside a launch also counts the
//! launch's own traffic before it. Two simplifications, both on the side of keeping data in the
//! cache longer than a GPU might: a read does not make its line newer, and a pointer chase's own
//! loads are not entered.

use std::collections::VecDeque;

#[derive(Debug, Clone, Copy)]
struct Extent {
    start: u64,
    end: u64,
    /// Bytes of traffic the extent made (a check that rewrites reads and writes every byte).
    traffic: u64,
    write: bool,
    descending: bool,
}

#[derive(Debug, Default)]
pub(crate) struct L2 {
    /// Its size in bytes; 0: no cache.
    pub(crate) bytes: u64,
    extents: VecDeque<Extent>,
    /// Traffic of all the extents held.
    held: u64,
}

/// Where a byte stands in the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Line {
    /// Not in the cache: a load reads the cell.
    Memory,
    /// In the cache, as the cell held it when it was loaded.
    Clean,
    /// In the cache, written and not yet written back: a load reads what was written.
    Dirty,
}

impl L2 {
    pub(crate) fn new(bytes: u64) -> L2 {
        L2 { bytes, ..L2::default() }
    }

    /// The GPU's work touched `[start, end)`, walking down from the top when `descending`,
    /// moving `traffic` bytes.
    pub(crate) fn touch(&mut self, start: u64, end: u64, traffic: u64, write: bool, descending: bool) {
        if self.bytes == 0 || end <= start {
            return;
        }
        self.extents.push_back(Extent { start, end, traffic, write, descending });
        self.held += traffic;
        // An extent all of whose bytes have a cache's worth of newer traffic is gone.
        while let Some(front) = self.extents.front() {
            if self.held - front.traffic >= self.bytes {
                self.held -= front.traffic;
                self.extents.pop_front();
            } else {
                break;
            }
        }
    }

    /// Where the byte at `addr` stands after `since` more bytes of traffic than the extents
    /// hold (the launch running now, up to this load).
    pub(crate) fn line(&self, addr: u64, since: u64) -> Line {
        if self.bytes == 0 {
            return Line::Memory;
        }
        let mut newer = since;
        let mut seen_clean = false;
        for e in self.extents.iter().rev() {
            if newer >= self.bytes {
                break;
            }
            if addr >= e.start && addr < e.end {
                // Traffic of this extent after `addr` in its walking order.
                let len = (e.end - e.start).max(1);
                let after = if e.descending { addr - e.start } else { e.end - 1 - addr };
                let depth = newer + (after as u128 * e.traffic as u128 / len as u128) as u64;
                if depth < self.bytes {
                    if e.write {
                        return Line::Dirty;
                    }
                    seen_clean = true;
                }
            }
            newer += e.traffic;
        }
        if seen_clean {
            Line::Clean
        } else {
            Line::Memory
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_bytes_written_stay_until_a_cache_of_traffic_follows() {
        let mut c = L2::new(1000);
        // 4000 bytes written upwards: the top 1000 are still in the cache, the rest written back.
        c.touch(0, 4000, 4000, true, false);
        assert_eq!(c.line(3999, 0), Line::Dirty);
        assert_eq!(c.line(3001, 0), Line::Dirty);
        assert_eq!(c.line(2999, 0), Line::Memory);
        // Walking down, the bottom is what was written last.
        let mut d = L2::new(1000);
        d.touch(0, 4000, 4000, true, true);
        assert_eq!((d.line(0, 0), d.line(3999, 0)), (Line::Dirty, Line::Memory));
        // Traffic of the launch now running counts too.
        assert_eq!(c.line(3999, 999), Line::Dirty);
        assert_eq!(c.line(3999, 1000), Line::Memory);
        // A write of twice the cache elsewhere leaves nothing of it.
        c.touch(10_000, 12_000, 2000, true, false);
        assert_eq!(c.line(3999, 0), Line::Memory);
        // A read leaves its lines clean.
        c.touch(0, 500, 500, false, false);
        assert_eq!(c.line(100, 0), Line::Clean);
    }

    #[test]
    fn no_cache_holds_nothing() {
        let mut c = L2::new(0);
        c.touch(0, 8, 8, true, false);
        assert_eq!(c.line(0, 0), Line::Memory);
    }
}
