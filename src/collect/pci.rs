//! PCI devices from `/sys/bus/pci/devices/*`: ids, class, bound driver, BARs, link state.
//!
//! Every device is read; a file that is missing or garbled becomes a `problem` on that device,
//! never a reason to drop it, because a half-readable GPU is exactly the one worth reporting.

use crate::snapshot::{Bar, Fact, PciDevice, PciLink};
use crate::sysroot::Sysroot;

const DEVICES: &str = "sys/bus/pci/devices";

pub fn read_devices(root: &Sysroot) -> Fact<Vec<PciDevice>> {
    let names = match root.list_dir(DEVICES) {
        Ok(n) => n,
        Err(e) => return Fact::Error(e.to_string()),
    };
    Fact::Value(names.iter().filter(|n| is_pci_address(n)).map(|n| read_device(root, n)).collect())
}

fn read_device(root: &Sysroot, address: &str) -> PciDevice {
    let dir = format!("{DEVICES}/{address}");
    let mut problems = Vec::new();
    let mut attr = |name: &str| -> Option<String> {
        match root.read_attr(&format!("{dir}/{name}")) {
            Ok(v) => Some(v),
            Err(e) => {
                problems.push(e.to_string());
                None
            }
        }
    };
    let vendor = attr("vendor");
    let device = attr("device");
    let class = attr("class");
    // Another vendor's device is counted and named, never judged (checks/pci.rs reads the
    // NVIDIA ones): its other files are not read. A guest has a dozen such devices or more, and
    // reading all of them was the largest part of an idle snapshot's CPU. An unreadable vendor
    // is read whole.
    let nvidia = vendor.as_deref().and_then(parse_hex).is_none_or(|v| v == crate::snapshot::NVIDIA_VENDOR as u64);
    let (subsystem_vendor, subsystem_device, resource) = match nvidia {
        true => (attr("subsystem_vendor"), attr("subsystem_device"), attr("resource")),
        false => (None, None, None),
    };
    let opt = |name: &str| if nvidia { root.read_attr(&format!("{dir}/{name}")).ok() } else { None };
    let numa_node = opt("numa_node");
    let link = parse_link(
        opt("current_link_speed").as_deref(),
        opt("max_link_speed").as_deref(),
        opt("current_link_width").as_deref(),
        opt("max_link_width").as_deref(),
    );
    let driver = match nvidia.then(|| root.link_name(&format!("{dir}/driver"))) {
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            problems.push(e.to_string());
            None
        }
        None => None,
    };
    let mut hex = |name: &str, v: Option<String>, bits: u32| -> Option<u64> {
        let v = v?;
        match parse_hex(&v) {
            Some(n) if bits == 64 || n < (1u64 << bits) => Some(n),
            _ => {
                problems.push(format!(
                    "{}: not a {bits}-bit hex number: {v:?}",
                    Sysroot::display(&format!("{dir}/{name}"))
                ));
                None
            }
        }
    };
    let vendor = hex("vendor", vendor, 16).map(|v| v as u16);
    let device = hex("device", device, 16).map(|v| v as u16);
    let class = hex("class", class, 24).map(|v| v as u32);
    let subsystem_vendor = hex("subsystem_vendor", subsystem_vendor, 16).map(|v| v as u16);
    let subsystem_device = hex("subsystem_device", subsystem_device, 16).map(|v| v as u16);
    let bars = match resource {
        Some(text) => {
            let (bars, bad) = parse_resource(&text);
            if bad > 0 {
                problems.push(format!("{}: {bad} malformed line(s)", Sysroot::display(&format!("{dir}/resource"))));
            }
            bars
        }
        None => Vec::new(),
    };
    PciDevice {
        address: address.to_string(),
        vendor,
        device,
        class,
        subsystem_vendor,
        subsystem_device,
        driver,
        bars,
        link,
        numa_node: numa_node.and_then(|n| n.parse().ok()),
        problems,
    }
}

/// `0000:09:00.0`: domain, bus, device, function.
pub fn is_pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && [0, 1, 2, 3, 5, 6, 8, 9, 11].iter().all(|&i| b[i].is_ascii_hexdigit())
}

/// `0x10de` → 0x10de. sysfs always writes the `0x` prefix; accept its absence too.
pub fn parse_hex(s: &str) -> Option<u64> {
    let s = s.trim();
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    if digits.is_empty() {
        return None;
    }
    u64::from_str_radix(digits, 16).ok()
}

/// Parses sysfs `resource`: one `start end flags` line (hex) per resource. Returns the
/// BARs 0–5 and the ROM (index 6), zero-sized ones included, and the count of bad lines.
pub fn parse_resource(text: &str) -> (Vec<Bar>, usize) {
    let mut bars = Vec::new();
    let mut bad = 0;
    for (index, line) in text.lines().enumerate() {
        let fields: Vec<Option<u64>> = line.split_whitespace().map(parse_hex).collect();
        let [Some(start), Some(end), Some(flags)] = fields[..] else {
            bad += 1;
            continue;
        };
        if index > 6 {
            continue; // SR-IOV and bridge windows: not BARs of this function
        }
        // An unused slot is all zeros; a resource the kernel could not place keeps its size
        // (end = size - 1) with start 0 and IORESOURCE_UNSET, which `Bar::assigned` sees.
        let size = if start == 0 && end == 0 || end < start { 0 } else { (end - start).saturating_add(1) };
        bars.push(Bar { index: index as u8, start, size, flags });
    }
    (bars, bad)
}

/// sysfs link attributes: speed as `32.0 GT/s PCIe` (older kernels: `8 GT/s`, or `Unknown`),
/// width as a plain number.
pub fn parse_link(
    cur_speed: Option<&str>,
    max_speed: Option<&str>,
    cur_width: Option<&str>,
    max_width: Option<&str>,
) -> PciLink {
    let gts = |s: Option<&str>| {
        s.and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok()).filter(|v| v.is_finite() && *v > 0.0)
    };
    let width = |s: Option<&str>| s.and_then(|s| s.trim().parse::<u32>().ok()).filter(|w| *w > 0 && *w <= 32);
    PciLink {
        current_speed: cur_speed.map(str::to_string),
        max_speed: max_speed.map(str::to_string),
        current_gts: gts(cur_speed),
        max_gts: gts(max_speed),
        current_width: width(cur_width),
        max_width: width(max_width),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The BAR layout of an HGX H100 from the lspci capture: regions 0 (16M), 2 (128G), 4 (32M),
    /// each 64-bit prefetchable, as the kernel prints them in `resource`.
    const H100_RESOURCE: &str = "\
0x0000214042000000 0x0000214042ffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000210000000000 0x0000211fffffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000214000000000 0x0000214001ffffff 0x000000000014220c
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
0x0000000000000000 0x0000000000000000 0x0000000000000000
";

    #[test]
    fn h100_bars_from_capture() {
        let (bars, bad) = parse_resource(H100_RESOURCE);
        assert_eq!(bad, 0);
        assert_eq!(bars.len(), 7);
        assert_eq!(bars[0].size, 16 << 20);
        assert_eq!(bars[2].size, 128 << 30);
        assert!(bars[2].assigned());
        assert_eq!(bars[4].size, 32 << 20);
        assert!(!bars[1].assigned());
    }

    #[test]
    fn truncated_resource_counts_bad_lines() {
        let (bars, bad) = parse_resource("0x0000214042000000 0x0000214042ffffff 0x000000000014220c\n0x00002100000");
        assert_eq!(bars.len(), 1);
        assert_eq!(bad, 1);
    }

    #[test]
    fn unset_resource_is_not_assigned() {
        // start 0, end size-1, IORESOURCE_UNSET: what the kernel leaves when placement failed
        let (bars, _) = parse_resource("0x0000000000000000 0x0000001fffffffff 0x000000002014220c\n");
        assert_eq!(bars[0].size, 128 << 30);
        assert!(!bars[0].assigned());
    }

    /// Another vendor's device is read for its identity alone: files it lacks beyond those are
    /// no problem, and a GPU beside it is read whole.
    #[test]
    fn other_vendors_devices_are_named_not_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let put = |dev: &str, name: &str, v: &str| {
            let d = dir.path().join(format!("{DEVICES}/{dev}"));
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join(name), v).unwrap();
        };
        for (n, v) in [("vendor", "0x8086\n"), ("device", "0x1237\n"), ("class", "0x060000\n")] {
            put("0000:00:00.0", n, v);
        }
        for (n, v) in [
            ("vendor", "0x10de\n"),
            ("device", "0x2335\n"),
            ("class", "0x030200\n"),
            ("subsystem_vendor", "0x10de\n"),
            ("subsystem_device", "0x18be\n"),
            ("resource", H100_RESOURCE),
        ] {
            put("0000:00:06.0", n, v);
        }
        let Fact::Value(devices) = read_devices(&Sysroot::new(dir.path())) else { panic!() };
        let (other, gpu) = (&devices[0], &devices[1]);
        assert_eq!((other.vendor, other.device, other.class), (Some(0x8086), Some(0x1237), Some(0x060000)));
        assert!(other.problems.is_empty(), "{:?}", other.problems);
        assert_eq!((gpu.device, gpu.subsystem_device, gpu.bars.len()), (Some(0x2335), Some(0x18be), 7));
    }

    #[test]
    fn link_attributes() {
        let l = parse_link(Some("32.0 GT/s PCIe"), Some("32.0 GT/s PCIe"), Some("16"), Some("16"));
        assert_eq!(l.current_gts, Some(32.0));
        assert_eq!(l.max_width, Some(16));
        let l = parse_link(Some("Unknown"), Some("8 GT/s"), Some("0"), None);
        assert_eq!(l.current_gts, None);
        assert_eq!(l.max_gts, Some(8.0));
        assert_eq!(l.current_width, None);
    }

    #[test]
    fn addresses() {
        assert!(is_pci_address("0000:09:00.0"));
        assert!(!is_pci_address("0000:09:00"));
        assert!(!is_pci_address("pci0000:00"));
    }

    proptest! {
        #[test]
        fn resource_never_panics(s in "[0-9a-fx \\n]{0,400}") {
            let (bars, _) = parse_resource(&s);
            prop_assert!(bars.len() <= 7);
        }

        #[test]
        fn resource_arbitrary_text(s in ".*") {
            let _ = parse_resource(&s);
        }

        #[test]
        fn link_never_panics(a in ".*", b in ".*", c in ".*", d in ".*") {
            let _ = parse_link(Some(&a), Some(&b), Some(&c), Some(&d));
        }

        #[test]
        fn hex_never_panics(s in ".*") {
            let _ = parse_hex(&s);
            let _ = is_pci_address(&s);
        }

        #[test]
        fn addresses_roundtrip(d in 0u16.., b in 0u8.., s in 0u8..32, f in 0u8..8) {
            let a = format!("{d:04x}:{b:02x}:{s:02x}.{f}");
            prop_assert!(is_pci_address(&a));
        }
    }
}
