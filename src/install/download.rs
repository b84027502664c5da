//! One download: a GET over HTTPS (or plain HTTP where a mirror is allowed it), its redirects
//! never from `https` down to `http` and at most ten, its body capped. What is downloaded is
//! verified by the caller before anything trusts it (`pgp.rs`); this room only fetches.

use std::time::Duration;

/// Why a download was refused or failed; each names what it saw.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("more than 10 redirects (the last to {to})")]
    TooManyRedirects { to: String },
    #[error("refused a redirect from {from} to {to}: from https down to {scheme}")]
    Downgrade { from: String, to: String, scheme: String },
    #[error("HTTP {0}")]
    Status(String),
    #[error("the server announces {bytes} bytes; refused above {max}")]
    Announced { bytes: u64, max: u64 },
    #[error("the body runs past {max} bytes; refused")]
    TooLong { max: u64 },
    /// The request failed on its way: the error and each of its causes.
    #[error("{0}")]
    Network(String),
    #[error("{0}")]
    Client(String),
}

/// What the installer downloads is small: a keyring package (about 4 KiB), a key, EPEL's release
/// package (about 20 KiB). A body past this is not what was asked for, and is not read on.
pub const MAX_DOWNLOAD_BYTES: u64 = 16 << 20;

/// Whether a redirect may be followed: never from `https` down to plain `http` (what TLS
/// protected would then come unprotected, from wherever the redirect points), at most ten in a
/// row (reqwest's own default policy, `redirect::Policy::default`, stops at ten).
pub fn redirect_allowed(from: &str, to: &str, hops: usize) -> Result<(), Refused> {
    if hops >= 10 {
        return Err(Refused::TooManyRedirects { to: to.into() });
    }
    let scheme = |u: &str| u.split_once("://").map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    if scheme(from) == "https" && scheme(to) != "https" {
        return Err(Refused::Downgrade { from: from.into(), to: to.into(), scheme: scheme(to) });
    }
    Ok(())
}

/// One GET of `url`: redirects only as `redirect_allowed` says, a body of at most `max` bytes.
pub fn download(url: &str, max: u64) -> Result<Vec<u8>, Refused> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Refused::Client(format!("cannot start the HTTP client: {e}")))?;
    rt.block_on(async {
        let policy = reqwest::redirect::Policy::custom(|attempt| {
            let from = attempt.previous().last().map(|u| u.to_string()).unwrap_or_default();
            match redirect_allowed(&from, attempt.url().as_str(), attempt.previous().len()) {
                Ok(()) => attempt.follow(),
                Err(e) => attempt.error(e),
            }
        });
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(120))
            .redirect(policy)
            .build()
            .map_err(|e| Refused::Client(e.to_string()))?;
        let mut resp = client.get(url).send().await.map_err(|e| Refused::Network(describe(&e.without_url())))?;
        if !resp.status().is_success() {
            return Err(Refused::Status(resp.status().to_string()));
        }
        if let Some(n) = resp.content_length().filter(|n| *n > max) {
            return Err(Refused::Announced { bytes: n, max });
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| Refused::Network(describe(&e.without_url())))? {
            if body.len() as u64 + chunk.len() as u64 > max {
                return Err(Refused::TooLong { max });
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    })
}

fn describe(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

#[cfg(test)]
mod tests;
