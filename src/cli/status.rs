//! `phq-agent status`: the running service's report, asked over D-Bus (`ch.phoeniqs.Agent1`),
//! else over HTTP from `http.listen` with the token in `http.token_file`.

use crate::report::{self, Report};
use anyhow::{bail, Context};
use clap::Args;
use std::io::{Read, Write};
use std::time::Duration;

#[derive(Debug, Args)]
pub struct Status {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

impl Status {
    pub fn run(self, g: &super::Global) -> anyhow::Result<i32> {
        let config = g.load_config()?;
        let json = match over_dbus() {
            Ok(j) => j,
            Err(dbus_err) => {
                tracing::info!(error = %dbus_err, "D-Bus did not answer; trying HTTP");
                over_http(&config)
                    .with_context(|| format!("the service answered neither on D-Bus ({dbus_err}) nor over HTTP"))?
            }
        };
        let r: Report = serde_json::from_str(&json).context("the service's report is not a phq.status/v1 report")?;
        if self.json {
            // The service's own JSON, as it sent it.
            super::print_out(&format!("{json}\n"), false)?;
        } else {
            super::print_report(&r, "phq-agent status", false)?;
        }
        Ok(report::exit_code(&r.findings))
    }
}

/// The D-Bus call, given 5 s (a wedged bus must not hang `status`).
fn over_dbus() -> anyhow::Result<String> {
    match crate::collect::units::within(Duration::from_secs(5), crate::serve::dbus::get_report) {
        Ok(r) => Ok(r?),
        Err(why) => bail!("{why}"),
    }
}

/// A plain HTTP/1.1 GET of /v1/status on the configured port (loopback when it listens on
/// every address).
fn over_http(config: &crate::config::Config) -> anyhow::Result<String> {
    let mut addr = config.http.listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
    }
    if !config.http.tls_cert.is_empty() {
        bail!("the service serves HTTPS; the HTTP fallback of `status` speaks plain HTTP only");
    }
    let token = crate::serve::read_token(&config.http.token_file)?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(3))
        .with_context(|| format!("cannot connect to {addr} (http.listen)"))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(s, "GET /v1/status HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n")?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp)?;
    let resp = String::from_utf8_lossy(&resp);
    let (head, body) = resp.split_once("\r\n\r\n").unwrap_or((&resp, ""));
    let code = head.split_whitespace().nth(1).unwrap_or("");
    if code != "200" {
        bail!("GET http://{addr}/v1/status answered {}", head.lines().next().unwrap_or(""));
    }
    Ok(body.to_string())
}
