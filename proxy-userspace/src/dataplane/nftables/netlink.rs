//! Set and map elements of vipr's tables written as one nf_tables netlink transaction, with
//! no `nft` process: `NFNL_MSG_BATCH_BEGIN`, `NFT_MSG_DELSETELEM` / `NFT_MSG_NEWSETELEM`
//! messages (`NFTA_SET_ELEM_LIST_{TABLE,SET,ELEMENTS}`), `NFNL_MSG_BATCH_END`, in one
//! datagram. The kernel applies the batch whole or not at all, as it does `nft -f`.
//!
//! Only elements (and a dump of the tables' names, [`families_with_table`]): the chains,
//! sets and rules stay `nft -f`'s. The elements are the ruleset's
//! own text (`ruleset::Set::elements`, as `nft -f` is given them), encoded here by the set's
//! declared type: the keys and values of a concatenation in the kernel's register layout
//! (every field padded to 4 bytes), addresses and ports in network order, `numgen`'s slot in
//! host order, verdicts as `NFTA_DATA_VERDICT`. What this cannot encode (an interval set, a
//! type it does not know) is refused before anything is sent, and the caller uses `nft`.
//!
//! Why (docs/benchmarks.md, "nftables"): an element-only change at 10k services costs
//! `nft -f` ~65 ms, nearly all of it nft's start and its cache of the table's chains and
//! sets; the same batch over netlink is the kernel's commit alone.
use std::{fmt, io, net::IpAddr};

use crate::dataplane::iptables::Family;
use crate::netlink::{
    align, message, nfgenmsg, nfnl_type, parse_attributes, Attributes, Received, Socket, HEADER_LEN,
    NETLINK_NETFILTER, NFGENMSG_LEN, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST,
};

use super::ruleset::{ElementChange, TABLE};

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;

const NFTA_TABLE_NAME: u16 = 1;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;

const NF_DROP: i32 = 0;
const NF_ACCEPT: i32 = 1;
const NFT_CONTINUE: i32 = -1;
const NFT_JUMP: i32 = -3;
const NFT_GOTO: i32 = -4;
const NFT_RETURN: i32 = -5;

/// The elements of one message stay under this many bytes: a nested attribute's length is
/// 16 bits.
const ELEMENTS_BYTES: usize = 60 * 1024;

/// One field of a set's key or value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    Ipv4,
    Ipv6,
    /// `inet_proto`: one byte.
    Protocol,
    /// `inet_service`: two bytes, network order.
    Port,
    /// `numgen`'s result: a 32-bit integer in host order.
    Integer,
    Verdict,
}

impl Field {
    fn of_type(name: &str) -> Option<Self> {
        Some(match name {
            "ipv4_addr" => Self::Ipv4,
            "ipv6_addr" => Self::Ipv6,
            "inet_proto" => Self::Protocol,
            "inet_service" => Self::Port,
            "verdict" => Self::Verdict,
            _ => return None,
        })
    }

    /// The type of a `typeof` expression.
    fn of_expression(expression: &str) -> Option<Self> {
        let words: Vec<&str> = expression.split_whitespace().collect();
        Some(match words.as_slice() {
            ["ip", "saddr" | "daddr"] => Self::Ipv4,
            ["ip6", "saddr" | "daddr"] => Self::Ipv6,
            ["meta", "l4proto"] => Self::Protocol,
            [_, "sport" | "dport"] => Self::Port,
            ["numgen", ..] => Self::Integer,
            _ => return None,
        })
    }

    /// The field's bytes, unpadded.
    fn encode(self, text: &str) -> Option<Vec<u8>> {
        Some(match self {
            Self::Ipv4 | Self::Ipv6 => match (self, text.parse::<IpAddr>().ok()?) {
                (Self::Ipv4, IpAddr::V4(ip)) => ip.octets().to_vec(),
                (Self::Ipv6, IpAddr::V6(ip)) => ip.octets().to_vec(),
                _ => return None,
            },
            Self::Protocol => vec![match text {
                "tcp" => libc::IPPROTO_TCP as u8,
                "udp" => libc::IPPROTO_UDP as u8,
                "sctp" => libc::IPPROTO_SCTP as u8,
                number => number.parse().ok()?,
            }],
            Self::Port => text.parse::<u16>().ok()?.to_be_bytes().to_vec(),
            Self::Integer => text.parse::<u32>().ok()?.to_ne_bytes().to_vec(),
            Self::Verdict => return None,
        })
    }
}

/// How a set's elements are encoded, read from its declaration (`ruleset::Set::spec`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    key: Vec<Field>,
    value: Option<Vec<Field>>,
}

impl Layout {
    /// `type A . B [: C] ;` or `typeof expr . expr [: expr . expr] ;`; `None` for what this
    /// module does not write (interval sets, unknown types).
    pub fn of_spec(spec: &str) -> Option<Self> {
        let mut statements = spec.split(';').map(str::trim).filter(|part| !part.is_empty());
        let declaration = statements.next()?;
        if statements.any(|statement| statement.starts_with("flags") && statement.contains("interval")) {
            return None;
        }
        let (fields, of): (&str, fn(&str) -> Option<Field>) =
            if let Some(rest) = declaration.strip_prefix("typeof ") {
                (rest, Field::of_expression)
            } else {
                (declaration.strip_prefix("type ")?, Field::of_type)
            };
        let parse =
            |text: &str| -> Option<Vec<Field>> { text.split(" . ").map(|field| of(field.trim())).collect() };
        let (key, value) = match fields.split_once(" : ") {
            Some((key, value)) => (parse(key)?, Some(parse(value)?)),
            None => (parse(fields)?, None),
        };
        if key.contains(&Field::Verdict)
            || value.as_ref().is_some_and(|v| v.len() > 1 && v.contains(&Field::Verdict))
        {
            return None;
        }
        Some(Self { key, value })
    }
}

/// A key or a value: one field as it is, several as a concatenation, each field padded to
/// the kernel's 4-byte registers.
fn encode_fields(fields: &[Field], text: &str) -> Option<Vec<u8>> {
    let parts: Vec<&str> = text.split(" . ").map(str::trim).collect();
    if parts.len() != fields.len() {
        return None;
    }
    if let ([field], [part]) = (fields, parts.as_slice()) {
        return field.encode(part);
    }
    let mut bytes = Vec::new();
    for (field, part) in fields.iter().zip(parts) {
        bytes.extend(field.encode(part)?);
        bytes.resize(align(bytes.len()), 0);
    }
    Some(bytes)
}

/// `drop`, `accept`, `return`, `continue`, `goto CHAIN`, `jump CHAIN`.
fn encode_verdict(text: &str) -> Option<Attributes> {
    let mut verdict = Attributes::new();
    let (code, chain) = match text.split_whitespace().collect::<Vec<_>>().as_slice() {
        ["drop"] => (NF_DROP, None),
        ["accept"] => (NF_ACCEPT, None),
        ["return"] => (NFT_RETURN, None),
        ["continue"] => (NFT_CONTINUE, None),
        ["goto", chain] => (NFT_GOTO, Some(*chain)),
        ["jump", chain] => (NFT_JUMP, Some(*chain)),
        _ => return None,
    };
    verdict.put(NFTA_VERDICT_CODE, &code.to_be_bytes());
    if let Some(chain) = chain {
        verdict.put_str(NFTA_VERDICT_CHAIN, chain);
    }
    Some(verdict)
}

/// One `NFTA_LIST_ELEM`'s attributes: the key, and the value of a map's element.
fn encode_element(layout: &Layout, key: &str, value: Option<&str>, delete: bool) -> Option<Attributes> {
    let mut element = Attributes::new();
    element.put_nested(
        NFTA_SET_ELEM_KEY,
        Attributes::new().put(NFTA_DATA_VALUE, &encode_fields(&layout.key, key)?),
    );
    // A deleted element is named by its key alone.
    match (&layout.value, value, delete) {
        (_, _, true) | (None, None, false) => {}
        (Some(fields), Some(value), false) => {
            let mut data = Attributes::new();
            if fields == &[Field::Verdict] {
                data.put_nested(NFTA_DATA_VERDICT, &encode_verdict(value)?);
            } else {
                data.put(NFTA_DATA_VALUE, &encode_fields(fields, value)?);
            }
            element.put_nested(NFTA_SET_ELEM_DATA, &data);
        }
        _ => return None,
    }
    Some(element)
}

impl ElementChange {
    /// The change's elements, borrowed, as [`ElementBatch::encode`] takes them.
    pub fn view(&self) -> Elements<'_> {
        Elements {
            set: &self.set,
            spec: &self.spec,
            delete: self.delete,
            elements: self.elements.iter().map(|(key, value)| (key.as_str(), value.as_deref())).collect(),
        }
    }
}

/// Elements of one set to add or delete, borrowed: from an [`ElementChange`], or from a
/// ruleset's set when a table is created (no copy of its strings).
#[derive(Clone, Debug)]
pub struct Elements<'a> {
    pub set: &'a str,
    pub spec: &'a str,
    pub delete: bool,
    pub elements: Vec<(&'a str, Option<&'a str>)>,
}

/// What each message of a batch carries, to name the element an error is about.
#[derive(Clone, Debug)]
struct Sent {
    sequence: u32,
    change: usize,
    /// The elements of the change in this message: (index, offset of its `NFTA_LIST_ELEM`
    /// from the message's netlink header).
    elements: Vec<(usize, usize)>,
}

/// A batch ready to send: the datagram, and what each message holds.
pub struct ElementBatch<'a> {
    family: Family,
    bytes: Vec<u8>,
    sent: Vec<Sent>,
    changes: Vec<Elements<'a>>,
}

/// Why a batch was not applied.
#[derive(Debug)]
pub enum BatchError {
    /// An element this module cannot write (the caller uses `nft`).
    Unsupported(String),
    /// The socket failed, or the kernel refused the batch (nothing of it was applied).
    Kernel { error: io::Error, element: Option<String>, explanation: Option<String> },
}

impl fmt::Display for BatchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unsupported(what) => write!(f, "not written over netlink: {what}"),
            Self::Kernel { error, element, explanation } => {
                write!(f, "nf_tables batch refused: {error}")?;
                if let Some(element) = element {
                    write!(f, " ({element})")?;
                }
                if let Some(explanation) = explanation {
                    write!(f, ": {explanation}")?;
                }
                Ok(())
            }
        }
    }
}

impl std::error::Error for BatchError {}

fn nfproto(family: Family) -> u8 {
    match family {
        Family::Ipv4 => libc::NFPROTO_IPV4 as u8,
        Family::Ipv6 => libc::NFPROTO_IPV6 as u8,
    }
}

impl<'a> ElementBatch<'a> {
    /// Encodes `changes` to `family`'s table, numbering the messages from `first_sequence`.
    pub fn encode(
        family: Family,
        changes: Vec<Elements<'a>>,
        first_sequence: u32,
    ) -> Result<Self, BatchError> {
        let mut sequence = first_sequence;
        let mut next = || {
            let current = sequence;
            sequence = sequence.wrapping_add(1);
            current
        };
        let header = nfgenmsg(libc::AF_UNSPEC as u8, NFNL_SUBSYS_NFTABLES);
        let mut bytes = message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, next(), &header);
        let mut sent = Vec::new();
        for (index, change) in changes.iter().enumerate() {
            let layout = Layout::of_spec(change.spec).ok_or_else(|| {
                BatchError::Unsupported(format!("set {} {{ {} }}", change.set, change.spec))
            })?;
            let mut start = 0;
            while start < change.elements.len() {
                let mut list = Attributes::new();
                let mut elements = Vec::new();
                let mut end = start;
                while end < change.elements.len() && list.bytes().len() < ELEMENTS_BYTES {
                    let (key, value) = change.elements[end];
                    let element = encode_element(&layout, key, value, change.delete).ok_or_else(|| {
                        BatchError::Unsupported(format!(
                            "element {} of set {} {{ {} }}",
                            render(key, value),
                            change.set,
                            change.spec
                        ))
                    })?;
                    elements.push((end, list.bytes().len()));
                    list.put_nested(NFTA_LIST_ELEM, &element);
                    end += 1;
                }
                let mut attributes = Attributes::new();
                attributes
                    .put_str(NFTA_SET_ELEM_LIST_TABLE, TABLE)
                    .put_str(NFTA_SET_ELEM_LIST_SET, change.set);
                // The elements' offsets in the message: header, nfgenmsg, the attributes
                // before, the list's own header.
                let base = HEADER_LEN + NFGENMSG_LEN + attributes.bytes().len() + 4;
                attributes.put_nested(NFTA_SET_ELEM_LIST_ELEMENTS, &list);
                let mut payload = nfgenmsg(nfproto(family), 0).to_vec();
                payload.extend_from_slice(attributes.bytes());
                let (kind, flags) = if change.delete {
                    (NFT_MSG_DELSETELEM, NLM_F_REQUEST | NLM_F_ACK)
                } else {
                    (NFT_MSG_NEWSETELEM, NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE)
                };
                let sequence = next();
                bytes.extend(message(nfnl_type(NFNL_SUBSYS_NFTABLES, kind), flags, sequence, &payload));
                sent.push(Sent {
                    sequence,
                    change: index,
                    elements: elements
                        .into_iter()
                        .map(|(element, offset)| (element, base + offset))
                        .collect(),
                });
                start = end;
            }
        }
        bytes.extend(message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, next(), &header));
        Ok(Self { family, bytes, sent, changes })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The element an error at `offset` of message `sequence` is about, as `nft` would
    /// print it.
    fn element_at(&self, sequence: u32, offset: Option<u32>) -> Option<String> {
        let sent = self.sent.iter().find(|sent| sent.sequence == sequence)?;
        let change = &self.changes[sent.change];
        let verb = if change.delete { "delete" } else { "add" };
        let prefix =
            format!("{verb} element {} {TABLE} {}", super::ruleset::family_name(self.family), change.set);
        let Some(offset) = offset.map(|offset| offset as usize) else {
            let first = sent.elements.first()?.0;
            let last = sent.elements.last()?.0;
            return Some(format!("{prefix}: one of elements {first}..={last} of this change"));
        };
        let (index, _) = sent.elements.iter().rev().find(|(_, start)| *start <= offset)?;
        let (key, value) = change.elements[*index];
        Some(format!("{prefix} {{ {} }}", render(key, value)))
    }

    /// Sends the batch in the calling thread's network namespace; `Ok` when the kernel
    /// acknowledged every message (the transaction is committed).
    pub fn send(&self, socket: &mut Socket) -> Result<(), BatchError> {
        let kernel = |error: io::Error| BatchError::Kernel { error, element: None, explanation: None };
        let acknowledgements = socket.send_batch(&self.bytes).map_err(kernel)?;
        if let Some(failed) = acknowledgements.iter().find(|acknowledgement| acknowledgement.code != 0) {
            return Err(BatchError::Kernel {
                error: io::Error::from_raw_os_error(-failed.code),
                element: self.element_at(failed.sequence, failed.offset),
                explanation: failed.text.clone(),
            });
        }
        let acknowledged = self
            .sent
            .iter()
            .filter(|sent| {
                acknowledgements.iter().any(|acknowledgement| acknowledgement.sequence == sent.sequence)
            })
            .count();
        if acknowledged != self.sent.len() {
            return Err(kernel(io::Error::other(format!(
                "{acknowledged} of {} messages acknowledged",
                self.sent.len()
            ))));
        }
        Ok(())
    }
}

fn render(key: &str, value: Option<&str>) -> String {
    match value {
        Some(value) => format!("{key} : {value}"),
        None => key.to_owned(),
    }
}

/// Applies `changes` to `family`'s table as one transaction, over a socket of its own in the
/// calling thread's network namespace (where `nft` would run).
pub fn apply(family: Family, changes: Vec<Elements<'_>>) -> Result<(), BatchError> {
    let kernel = |error: io::Error| BatchError::Kernel { error, element: None, explanation: None };
    let mut socket = Socket::open(NETLINK_NETFILTER).map_err(kernel)?;
    socket.extended_acknowledgements().map_err(kernel)?;
    let first = socket.next_sequence();
    let batch = ElementBatch::encode(family, changes, first)?;
    batch.send(&mut socket)
}

/// The families that have a table named `name` in the calling thread's network namespace:
/// one `NFT_MSG_GETTABLE` dump, which the kernel answers with the tables alone. (`nft list
/// tables` in nft 1.0.6 fetches every table's chains, rules, sets and elements into its cache
/// first: 2 s with a 10k-service table.)
pub fn families_with_table(name: &str) -> io::Result<Vec<Family>> {
    let mut socket = Socket::open(NETLINK_NETFILTER)?;
    let replies = socket
        .dump(nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETTABLE), &nfgenmsg(libc::NFPROTO_UNSPEC as u8, 0))?;
    let tables = tables_of(&replies);
    Ok(Family::ALL
        .into_iter()
        .filter(|family| {
            tables.iter().any(|(nfproto, table)| *nfproto == self::nfproto(*family) && table == name)
        })
        .collect())
}

/// The (nfproto family, name) of each `NFT_MSG_NEWTABLE` of a table dump.
fn tables_of(replies: &[Received]) -> Vec<(u8, String)> {
    replies
        .iter()
        .filter(|reply| reply.kind == nfnl_type(NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWTABLE))
        .filter_map(|reply| {
            let family = *reply.payload.first()?;
            let name = parse_attributes(reply.payload.get(NFGENMSG_LEN..)?)
                .find(|attribute| attribute.kind == NFTA_TABLE_NAME)?
                .str()?
                .to_owned();
            Some((family, name))
        })
        .collect()
}

#[cfg(test)]
mod tests;
