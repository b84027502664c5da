//! The repository's own scripts that the tests and CI lean on.

mod common;

use std::path::Path;
use std::process::Command;

/// `scripts/debian-mirror` with `PHQ_APT_ROOT` standing for `/`: (exit code, stdout, stderr).
fn mirror(root: &Path, override_: Option<&str>) -> (i32, String, String) {
    let mut c = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/debian-mirror"));
    c.env("PHQ_APT_ROOT", root).env_remove("PHQ_DEBIAN_MIRROR");
    if let Some(m) = override_ {
        c.env("PHQ_DEBIAN_MIRROR", m);
    }
    let out = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_debian_mirror_comes_from_the_machines_own_apt_sources() {
    let dir = tempfile::tempdir().unwrap();
    let apt = dir.path().join("etc/apt");
    std::fs::create_dir_all(apt.join("sources.list.d")).unwrap();

    // Nothing configured: a clear error naming the variable, and no made-up host.
    let (code, out, err) = mirror(dir.path(), None);
    assert_eq!((code, out.as_str()), (1, ""));
    assert!(err.contains("PHQ_DEBIAN_MIRROR"), "{err}");

    // One-line sources: security and updates suites are passed over, options are skipped.
    std::fs::write(
        apt.join("sources.list"),
        "# a comment\ndeb [signed-by=/k.gpg] http://m1.test/debian-security bookworm-security main\n\
         deb-src http://src.test/debian bookworm main\ndeb [arch=amd64 signed-by=/k.gpg] http://m1.test/debian/ bookworm main contrib\n",
    )
    .unwrap();
    assert_eq!(mirror(dir.path(), None).1, "http://m1.test/debian");

    // deb822 wins over one-line sources, as Debian 12's images ship it.
    std::fs::write(
        apt.join("sources.list.d/debian.sources"),
        "Types: deb\nURIs: http://m2.test/debian-security\nSuites: bookworm-security\nComponents: main\n\n\
         Types: deb deb-src\nURIs: http://m2.test/debian\nSuites: bookworm bookworm-updates\nComponents: main non-free-firmware\n",
    )
    .unwrap();
    assert_eq!(mirror(dir.path(), None).1, "http://m2.test/debian");

    // The documented override beats both.
    assert_eq!(mirror(dir.path(), Some("http://m3.test/debian/")).1, "http://m3.test/debian");
}

/// The committed Xid/SXid table (src/checks/xid/catalog.rs) is exactly what the generator writes
/// from data/, so the data files stay the one place the catalog is edited.
#[test]
fn the_xid_catalog_is_what_its_generator_writes() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Ok(out) = Command::new("python3").arg(repo.join("scripts/gen-xid-catalog")).arg("--check").output() else {
        common::skip("python3 is not installed, so scripts/gen-xid-catalog cannot run");
        return;
    };
    let said = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("172 Xids (109 in use"), "{said}");
}
