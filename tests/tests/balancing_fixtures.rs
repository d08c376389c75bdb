//! How vipr's TC program picks a new connection's backend, run with BPF_PROG_TEST_RUN:
//! ClientIP session affinity (remembered per client and service port, bounded by the
//! service's timeout and by the backend set's membership) and Maglev consistent hashing (the
//! same backend for a flow from identical tables, and about 1/N of the flows moved when one
//! of N backends goes), and a connection's packet past its handshake that finds no entry
//! while an upgrade switches maps held back, not balanced anew.
//!
//! Needs root (BPF and mount); every harness has its own private bpffs.

use testbed::fixtures::{frame, harness};

use std::collections::{BTreeMap, BTreeSet};

use anyhow::{anyhow, ensure, Result};
use frame::{ep, parse_ipv4, Ep, Packet, IPPROTO_TCP};
use harness::{flow_key, verdict_name, Harness, TC_ACT_OK, TC_ACT_SHOT};
use proxy_common::{datapath_stat, service_flags, Service};
use vipr::dataplane::ebpf::maglev;

const FRONTEND: Ep = ep([10, 96, 0, 80], 80);
const SERVICE_ID: u32 = 77;

fn backends(count: u8) -> Vec<Ep> {
    (1..=count).map(|i| ep([10, 244, 7, i], 8080)).collect()
}

/// Runs one new TCP connection's first packet; the backend it was sent to.
fn connect(h: &Harness, client: Ep) -> Result<Ep> {
    let (verdict, out) = h.run(&Packet::tcp(client, FRONTEND).build())?;
    ensure!(verdict == TC_ACT_OK, "{client}: verdict {}", verdict_name(verdict));
    let view = parse_ipv4(&out).map_err(|error| anyhow!("{client}: output: {error}"))?;
    Ok(view.destination())
}

/// `CLOCK_MONOTONIC_COARSE`, the clock of `bpf_ktime_get_coarse_ns`.
fn kernel_now_ns() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut now) };
    now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64
}

// ---------------------------------------------------------------------------------------------
// Session affinity.

const AFFINITY_SECONDS: u32 = 60;

/// A service over `backends` in set `set`, with its membership entries, with affinity.
fn affinity_service(h: &mut Harness, set: u32, backends: &[Ep]) -> Result<()> {
    for (slot, backend) in backends.iter().enumerate() {
        h.set_backend(set, slot as u32, *backend)?;
        h.set_member(set, *backend, slot as u32)?;
    }
    let service = Service {
        backend_set: set,
        backend_count: backends.len() as u32,
        service_id: SERVICE_ID,
        affinity_timeout: AFFINITY_SECONDS,
        ..Service::default()
    };
    h.store_service(FRONTEND, IPPROTO_TCP, service)
}

#[test]
fn affinity_keeps_each_client_on_one_backend() {
    affinity_per_client().unwrap_or_else(|error| panic!("{error:#}"));
}

fn affinity_per_client() -> Result<()> {
    let backends = backends(4);
    let mut h = Harness::new()?;
    affinity_service(&mut h, 1, &backends)?;
    let mut chosen_per_client = BTreeMap::new();
    for client_host in 1..=12u8 {
        let client = [192, 168, 9, client_host];
        let mut chosen = BTreeSet::new();
        for port in 0..20 {
            chosen.insert(connect(&h, ep(client, 30000 + port))?);
        }
        ensure!(chosen.len() == 1, "client {client:?} was spread over {chosen:?}");
        let backend = *chosen.first().expect("one backend");
        let remembered =
            h.affinity(SERVICE_ID, client)?.ok_or_else(|| anyhow!("{client:?} not remembered"))?;
        ensure!(ep(remembered.addr, remembered.port) == backend, "remembered {remembered:?}, used {backend}");
        chosen_per_client.insert(client_host, backend);
    }
    // Each client's first choice is random: twelve clients on one of four backends would mean
    // affinity stuck to one backend for everybody (probability 4 × (1/4)^12).
    let distinct: BTreeSet<Ep> = chosen_per_client.values().copied().collect();
    ensure!(distinct.len() > 1, "every client went to {distinct:?}");
    Ok(())
}

#[test]
fn affinity_ends_with_its_timeout_or_its_backend() {
    affinity_bounds().unwrap_or_else(|error| panic!("{error:#}"));
}

fn affinity_bounds() -> Result<()> {
    let backends = backends(3);
    let client = [192, 168, 9, 50];
    let mut h = Harness::new()?;
    affinity_service(&mut h, 1, &backends)?;

    // A fresh memory is followed, whatever the random choice would have been.
    for port in 0..10 {
        h.set_affinity(SERVICE_ID, client, backends[2], kernel_now_ns())?;
        ensure!(connect(&h, ep(client, 31000 + port))? == backends[2], "fresh affinity not followed");
    }

    // An expired memory is not: the choice is random again (all 40 on backends[2] would have
    // probability (1/3)^40), and the new choice is remembered from now on.
    let mut after_expiry = BTreeSet::new();
    for port in 0..40 {
        let expired = kernel_now_ns() - (u64::from(AFFINITY_SECONDS) + 1) * 1_000_000_000;
        h.set_affinity(SERVICE_ID, client, backends[2], expired)?;
        let backend = connect(&h, ep(client, 32000 + port))?;
        after_expiry.insert(backend);
        let remembered = h.affinity(SERVICE_ID, client)?.ok_or_else(|| anyhow!("not remembered"))?;
        ensure!(remembered.since > expired, "the new choice's time was not recorded");
        ensure!(ep(remembered.addr, remembered.port) == backend, "the new choice was not remembered");
    }
    ensure!(after_expiry.len() > 1, "expired affinity still followed: {after_expiry:?}");

    // A remembered backend the service no longer has is not followed, even when fresh.
    let gone = ep([10, 244, 7, 99], 8080);
    for port in 0..10 {
        h.set_affinity(SERVICE_ID, client, gone, kernel_now_ns())?;
        let backend = connect(&h, ep(client, 33000 + port))?;
        ensure!(backends.contains(&backend), "sent to {backend}, which the service does not have");
    }

    // A backend kept across a change of backend set keeps its clients: the service moves to a
    // new set that still holds backends[1], in another slot.
    let moved = [backends[1], ep([10, 244, 7, 4], 8080)];
    for (slot, backend) in moved.iter().enumerate() {
        h.set_backend(2, slot as u32, *backend)?;
        h.set_member(2, *backend, slot as u32)?;
    }
    let service = Service {
        backend_set: 2,
        backend_count: 2,
        service_id: SERVICE_ID,
        affinity_timeout: AFFINITY_SECONDS,
        ..Service::default()
    };
    h.store_service(FRONTEND, IPPROTO_TCP, service)?;
    h.set_affinity(SERVICE_ID, client, backends[1], kernel_now_ns())?;
    for port in 0..10 {
        ensure!(connect(&h, ep(client, 34000 + port))? == backends[1], "affinity lost with the set change");
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Maglev.

const TABLE_SIZE: u32 = 1021;

/// The service's backend set `set` becomes the Maglev table of `backends`.
fn maglev_service(h: &mut Harness, set: u32, backends: &[Ep]) -> Result<()> {
    let identities: Vec<[u8; 6]> = backends
        .iter()
        .map(|backend| {
            let [a, b, c, d] = backend.addr;
            let [high, low] = backend.port.to_be_bytes();
            [a, b, c, d, high, low]
        })
        .collect();
    for (slot, owner) in maglev::table(&identities, TABLE_SIZE).into_iter().enumerate() {
        h.set_backend(set, slot as u32, backends[owner])?;
    }
    let service = Service {
        backend_set: set,
        backend_count: TABLE_SIZE,
        service_id: SERVICE_ID,
        flags: service_flags::MAGLEV,
        ..Service::default()
    };
    h.store_service(FRONTEND, IPPROTO_TCP, service)
}

/// Many flows: clients from several addresses and ports.
fn flows() -> Vec<Ep> {
    (0..2000u16).map(|i| ep([172, 16, (i % 7) as u8, (i % 251) as u8 + 1], 20000 + i)).collect()
}

/// The backend each flow is sent to, every flow new.
fn choices(h: &mut Harness) -> Result<Vec<Ep>> {
    h.clear_flows()?;
    flows().into_iter().map(|client| connect(h, client)).collect()
}

#[test]
fn maglev_agrees_across_nodes_and_moves_about_one_nth_of_the_flows() {
    maglev_disruption().unwrap_or_else(|error| panic!("{error:#}"));
}

fn maglev_disruption() -> Result<()> {
    let all = backends(10);
    // Two "nodes": separate programs and maps, the table built from the backends in
    // different orders.
    let mut node_a = Harness::new()?;
    let mut node_b = Harness::new()?;
    maglev_service(&mut node_a, 1, &all)?;
    let mut reversed = all.clone();
    reversed.reverse();
    maglev_service(&mut node_b, 1, &reversed)?;
    let before = choices(&mut node_a)?;
    ensure!(before == choices(&mut node_b)?, "two nodes chose differently for the same flows");
    ensure!(before == choices(&mut node_a)?, "one node chose differently the second time");
    let used: BTreeSet<Ep> = before.iter().copied().collect();
    ensure!(used.len() == all.len(), "only {} of {} backends used", used.len(), all.len());

    // One backend goes: the service switches to a new table without it.
    let removed = all[3];
    let remaining: Vec<Ep> = all.iter().copied().filter(|backend| *backend != removed).collect();
    maglev_service(&mut node_a, 2, &remaining)?;
    let after = choices(&mut node_a)?;
    let moved = before.iter().zip(&after).filter(|(before, after)| before != after).count();
    let orphaned = before.iter().filter(|backend| **backend == removed).count();
    let kept_off_removed = before
        .iter()
        .zip(&after)
        .filter(|(before, _)| **before != removed)
        .all(|(_, after)| *after != removed);
    ensure!(kept_off_removed && !after.contains(&removed), "a flow still goes to the removed backend");
    let share = moved as f64 / before.len() as f64;
    println!(
        "maglev disruption: {moved} of {} flows moved ({:.1}%), {orphaned} of them from the removed backend; \
         ideal 1/N = {:.1}%",
        before.len(),
        share * 100.0,
        100.0 / all.len() as f64
    );
    // Random choice would move ~90% of the flows; Maglev ~1/N plus a little.
    ensure!(share < 0.1 * 1.5 + 0.02, "{:.1}% of the flows moved", share * 100.0);
    Ok(())
}

/// While an upgrade switches to new maps (the agent's deadline ahead), a TCP packet past its
/// handshake without an entry is dropped and counted, stored nowhere: its connection's entry
/// is on its way from the earlier map, and another backend would reset it. A SYN is balanced
/// meanwhile; once the deadline passed (or is lifted), the same packet is balanced too. A
/// held packet to a service with session affinity leaves its client unremembered: the carried
/// connection's backend is the one to remember, and a choice made for a dropped packet would
/// keep the client's next connections elsewhere.
#[test]
fn a_packet_past_its_handshake_without_an_entry_waits_while_an_upgrade_switches_maps() {
    switch_hold().unwrap_or_else(|err| panic!("{err:#}"));
}

fn switch_hold() -> Result<()> {
    let mut h = Harness::new()?;
    h.add_service(FRONTEND, IPPROTO_TCP, 1, &backends(3))?;
    let mid_stream = ep([203, 0, 113, 9], 40001);
    let stored = |h: &Harness, client: Ep| -> Result<bool> {
        Ok(h.flows()?.contains_key(&flow_key(client, FRONTEND, IPPROTO_TCP)))
    };

    h.set_switch_deadline(kernel_now_ns() + 60_000_000_000)?;
    let (verdict, _) = h.run(&Packet::tcp(mid_stream, FRONTEND).tcp_flags(0x10).build())?;
    ensure!(verdict == TC_ACT_SHOT, "an ACK without an entry mid-switch: verdict {}", verdict_name(verdict));
    ensure!(!stored(&h, mid_stream)?, "the held ACK's connection was stored");
    ensure!(h.datapath_stat(datapath_stat::SWITCH_HELD)? == 1, "SWITCH_HELD not counted");
    let opening = ep([203, 0, 113, 9], 40002);
    let (verdict, _) = h.run(&Packet::tcp(opening, FRONTEND).tcp_flags(0x02).build())?;
    ensure!(
        verdict == TC_ACT_OK && stored(&h, opening)?,
        "a SYN mid-switch: verdict {}",
        verdict_name(verdict)
    );

    for (deadline, what) in [(kernel_now_ns() - 1, "past"), (0, "lifted")] {
        h.set_switch_deadline(deadline)?;
        let client = ep([203, 0, 113, 9], if deadline == 0 { 40004 } else { 40003 });
        let (verdict, _) = h.run(&Packet::tcp(client, FRONTEND).tcp_flags(0x10).build())?;
        ensure!(
            verdict == TC_ACT_OK && stored(&h, client)?,
            "an ACK without an entry, the deadline {what}: verdict {}",
            verdict_name(verdict)
        );
    }
    ensure!(h.datapath_stat(datapath_stat::SWITCH_HELD)? == 1, "SWITCH_HELD counted more");

    affinity_service(&mut h, 2, &backends(3))?;
    h.set_switch_deadline(kernel_now_ns() + 60_000_000_000)?;
    let client = [203, 0, 113, 10];
    let (verdict, _) = h.run(&Packet::tcp(ep(client, 40005), FRONTEND).tcp_flags(0x10).build())?;
    ensure!(
        verdict == TC_ACT_SHOT,
        "an ACK to an affinity service mid-switch: verdict {}",
        verdict_name(verdict)
    );
    ensure!(h.datapath_stat(datapath_stat::SWITCH_HELD)? == 2, "the second hold not counted");
    let remembered = h.affinity(SERVICE_ID, client)?;
    ensure!(remembered.is_none(), "a held packet's client was remembered: {remembered:?}");
    Ok(())
}
