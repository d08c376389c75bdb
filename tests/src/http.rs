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
    /// Every header field, names in lower case, in the order received.
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpAnswer {
    /// The value of header field `name` (any case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(field, _)| field.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    }

    /// The value of the sample `name` (written with its labels, `name{labels}`, if it has any)
    /// in a Prometheus text body.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.body.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
    }
}

/// `GET path` on `address`, connecting from inside `netns`.
pub fn get(netns: &Netns, address: SocketAddr, path: &str) -> Result<HttpAnswer> {
    get_within(netns, address, path, TIMEOUT)
}

/// [`get`], failing if connecting, or any wait for the answer's bytes, takes longer than
/// `timeout` (for probes with a deadline, as a kubelet's liveness probe has).
pub fn get_within(netns: &Netns, address: SocketAddr, path: &str, timeout: Duration) -> Result<HttpAnswer> {
    let mut stream = netns.run(|| Ok(TcpStream::connect_timeout(&address, timeout)?))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    // HTTP/1.0: the server closes after answering and never chunks the body.
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw.split_once("\r\n\r\n").with_context(|| format!("no header end in {raw:?}"))?;
    let status =
        head.split(' ').nth(1).and_then(|code| code.parse().ok()).with_context(|| format!("{head:?}"))?;
    let headers: Vec<(String, String)> = head
        .lines()
        .skip(1)
        .filter_map(|line| {
            let (field, value) = line.split_once(':')?;
            Some((field.trim().to_ascii_lowercase(), value.trim().to_owned()))
        })
        .collect();
    let mut answer = HttpAnswer { status, content_type: String::new(), headers, body: body.to_owned() };
    answer.content_type = answer.header("content-type").unwrap_or_default().to_owned();
    Ok(answer)
}
