//! A minimal HTTP client for vipr's own servers (`/healthz`, `/metrics`, `/proxyMode`, health
//! check node ports), which answer HTTP/1.0 requests and close: no client library needed.
use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::Netns;

const TIMEOUT: Duration = Duration::from_secs(5);

/// What a `GET` got back.
#[derive(Debug)]
pub struct HttpAnswer {
    pub status: u16,
    /// The `Content-Type` header; empty without one.
    pub content_type: String,
    pub body: String,
}

impl HttpAnswer {
    /// The value of the sample `name` (written with its labels, `name{labels}`, if it has any)
    /// in a Prometheus text body.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.body.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }
}

/// `GET path` on `address`, connecting from inside `netns`.
pub fn get(netns: &Netns, address: SocketAddr, path: &str) -> Result<HttpAnswer> {
    let mut stream = netns.run(|| Ok(TcpStream::connect_timeout(&address, TIMEOUT)?))?;
    stream.set_read_timeout(Some(TIMEOUT))?;
    // HTTP/1.0: the server closes after answering and never chunks the body.
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").with_context(|| format!("no header end in {raw:?}"))?;
    let status =
        head.split(' ').nth(1).and_then(|code| code.parse().ok()).with_context(|| format!("{head:?}"))?;
    let content_type = head
        .lines()
        .find_map(|line| {
            let (field, value) = line.split_once(':')?;
            field.eq_ignore_ascii_case("content-type").then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Ok(HttpAnswer { status, content_type, body: body.to_owned() })
}
