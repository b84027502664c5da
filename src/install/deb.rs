//! One member of a .deb, read through `dpkg-deb --fsys-tarfile` as it unpacks, bounded: the
//! keyring package's key is taken out of it and nothing else, and never more than a keyring's
//! worth is kept, however much a mirror's package unpacks to.

use super::runner::Runner;
use std::io::Read;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum DebError {
    #[error("dpkg-deb: {0}")]
    Run(std::io::Error),
    #[error(
        "{deb}: its contents run past {MAX_DEB_TAR_BYTES} bytes unpacked (dpkg-deb --fsys-tarfile); refused, and dpkg-deb stopped: a keyring package is a few KiB"
    )]
    TooLong { deb: String },
    #[error("{deb}: {member} is {size} bytes, past the {MAX_DEB_MEMBER_BYTES}-byte cap for a keyring; refused")]
    TooLarge { deb: String, member: String, size: u64 },
    #[error("{deb} is not a valid .deb: {stderr}")]
    Invalid { deb: String, stderr: String },
    #[error("{deb} holds no {member}")]
    Missing { deb: String, member: String },
    #[error("{deb}: {source}")]
    Unreadable { deb: String, source: std::io::Error },
}

/// The keyring package is a few KiB: its key (about 2 KiB), a source list and its docs. A
/// member past this is not a keyring.
pub const MAX_DEB_MEMBER_BYTES: u64 = 1 << 20;
/// How much of the package's unpacked tar stream is read at most. A mirror's package may
/// unpack without end (a compression bomb): past this the reading stops, and with it dpkg-deb.
pub const MAX_DEB_TAR_BYTES: u64 = 16 << 20;

/// `dpkg-deb --fsys-tarfile` unpacks whatever compression the .deb uses; the member is read
/// from that tar stream as dpkg-deb writes it, without writing anything to disk and without
/// keeping more than the member (`MAX_DEB_MEMBER_BYTES`) or reading more than
/// `MAX_DEB_TAR_BYTES` of the stream.
pub fn deb_member_bytes(deb: &Path, member: &str, runner: &mut dyn Runner) -> Result<Vec<u8>, DebError> {
    let deb_s = deb.display().to_string();
    let mut found = TarMember::Missing;
    let out = runner
        .run_reading("dpkg-deb", &["--fsys-tarfile".into(), deb_s.clone()], &mut |stdout| {
            found = tar_member(stdout, member, MAX_DEB_TAR_BYTES, MAX_DEB_MEMBER_BYTES);
        })
        .map_err(DebError::Run)?;
    match found {
        // Stopped by the cap: dpkg-deb's exit (a broken pipe) says nothing about the package.
        TarMember::StreamTooLong => Err(DebError::TooLong { deb: deb_s }),
        TarMember::TooLarge(size) => Err(DebError::TooLarge { deb: deb_s, member: member.into(), size }),
        _ if !out.ok() => Err(DebError::Invalid { deb: deb_s, stderr: out.stderr.trim().into() }),
        TarMember::Found(bytes) => Ok(bytes),
        TarMember::Missing => Err(DebError::Missing { deb: deb_s, member: member.into() }),
        TarMember::Unreadable(source) => Err(DebError::Unreadable { deb: deb_s, source }),
    }
}

/// What a bounded read of a tar stream found of one member.
#[derive(Debug)]
enum TarMember {
    Found(Vec<u8>),
    Missing,
    /// The member's size, past the cap.
    TooLarge(u64),
    /// The stream ran past its cap.
    StreamTooLong,
    Unreadable(std::io::Error),
}

/// Reads the tar stream `input` to its end, or to `max_stream` bytes, keeping only `member`
/// (`./` or not) when it is at most `max_member` bytes.
fn tar_member(input: &mut dyn Read, member: &str, max_stream: u64, max_member: u64) -> TarMember {
    let mut capped = Capped { inner: input, left: max_stream, over: false };
    let read = |archive: &mut tar::Archive<&mut Capped<'_>>| -> std::io::Result<TarMember> {
        for entry in archive.entries()? {
            let mut entry = entry?;
            let path = entry.path().map(|p| p.display().to_string()).unwrap_or_default();
            if path.trim_start_matches("./") != member {
                continue;
            }
            let size = entry.header().size()?;
            if size > max_member {
                return Ok(TarMember::TooLarge(size));
            }
            let mut buf = Vec::new();
            (&mut entry).take(max_member).read_to_end(&mut buf)?;
            return Ok(TarMember::Found(buf));
        }
        Ok(TarMember::Missing)
    };
    let found = read(&mut tar::Archive::new(&mut capped)).unwrap_or_else(TarMember::Unreadable);
    // The rest of the stream, so dpkg-deb ends on its own and its exit status tells.
    if !matches!(found, TarMember::TooLarge(_)) {
        let _ = std::io::copy(&mut capped, &mut std::io::sink());
    }
    if capped.over {
        TarMember::StreamTooLong
    } else {
        found
    }
}

/// A reader that gives at most `left` bytes and then fails, noting in `over` that there was
/// more (a stream that ends exactly at the cap is not over it).
struct Capped<'a> {
    inner: &'a mut dyn Read,
    left: u64,
    over: bool,
}

impl Read for Capped<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            let mut one = [0u8; 1];
            if self.inner.read(&mut one)? == 0 {
                return Ok(0);
            }
            self.over = true;
            return Err(std::io::Error::other("past the cap"));
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        self.left -= n as u64;
        Ok(n)
    }
}
