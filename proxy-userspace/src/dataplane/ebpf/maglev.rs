//! Maglev consistent hashing (Eisenbud et al., NSDI 2016) for `--lb-algorithm=maglev`.
//!
//! A Maglev table is a backend set whose `M` slots (M prime) each name one backend; the
//! datapath picks slot `hash(5-tuple) % M` instead of a random one. Two properties make it
//! worth the memory:
//! - every node builds the same table from the same endpoints, so a flow that reaches another
//!   node (ECMP change, node failover) lands on the same backend: the table depends only on the
//!   backends' identities, never on the order the agent learnt them or on anything per node;
//! - when a backend comes or goes, only about 1/N of the slots change owner.
//!
//! Each backend fills slots in its own pseudo-random order (a permutation of `0..M` given by an
//! offset and a skip derived from two hashes of its identity), the backends taking turns until
//! the table is full. The hashes are written out here rather than taken from std, whose
//! `DefaultHasher` may change between Rust releases: nodes running different vipr builds must
//! still agree.

/// The table sizes `--maglev-table-size` accepts: primes, so every skip in `1..M` generates a
/// full permutation. Maglev's paper asks for M ≫ N (at least 100 × the backends) for an even
/// spread; larger tables cost backend-map entries per service.
pub const TABLE_SIZES: &[u32] = &[251, 509, 1021, 2039, 4093, 8191, 16381, 32749, 65521, 131071];

/// The default: 100 backends per service spread within about 1% of each other, at 1021
/// backend-map entries per Maglev service.
pub const DEFAULT_TABLE_SIZE: u32 = 1021;

/// Builds the table: `table[slot]` is the index in `backends` of the slot's owner. `backends`
/// are the identities (e.g. address and port bytes) of distinct backends; their order does not
/// matter. Empty when there are no backends.
pub fn table<B: AsRef<[u8]>>(backends: &[B], size: u32) -> Vec<usize> {
    if backends.is_empty() || size == 0 {
        return Vec::new();
    }
    let size = u64::from(size);
    // Sorting by identity makes the turn order, and so the table, independent of input order.
    let mut order: Vec<usize> = (0..backends.len()).collect();
    order.sort_by(|&a, &b| backends[a].as_ref().cmp(backends[b].as_ref()));
    let permutations: Vec<(u64, u64)> = order
        .iter()
        .map(|&index| {
            let identity = backends[index].as_ref();
            let offset = hash(identity, OFFSET_SEED) % size;
            let skip = hash(identity, SKIP_SEED) % (size - 1).max(1) + 1;
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; order.len()];
    let mut owners: Vec<Option<usize>> = vec![None; size as usize];
    let mut filled = 0u64;
    'fill: loop {
        for (turn, &index) in order.iter().enumerate() {
            let (offset, skip) = permutations[turn];
            let slot = loop {
                let candidate = ((offset + next[turn] * skip) % size) as usize;
                next[turn] += 1;
                if owners[candidate].is_none() {
                    break candidate;
                }
            };
            owners[slot] = Some(index);
            filled += 1;
            if filled == size {
                break 'fill;
            }
        }
    }
    owners.into_iter().map(|owner| owner.unwrap_or_default()).collect()
}

const OFFSET_SEED: u64 = 0x6d61_676c_6576_3031; // "maglev01"
const SKIP_SEED: u64 = 0x6d61_676c_6576_3032; // "maglev02"

/// FNV-1a over the bytes, finished with SplitMix64's mixer so that identities differing in one
/// byte land far apart.
fn hash(bytes: &[u8], seed: u64) -> u64 {
    let mut state = 0xcbf2_9ce4_8422_2325 ^ seed;
    for &byte in bytes {
        state ^= u64::from(byte);
        state = state.wrapping_mul(0x0000_0100_0000_01b3);
    }
    state = (state ^ (state >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    state = (state ^ (state >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    state ^ (state >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backends(count: u8) -> Vec<[u8; 6]> {
        (0..count).map(|i| [10, 0, i / 250, i % 250 + 1, 0x1f, 0x90]).collect()
    }

    fn owners<'a>(table: &[usize], backends: &'a [[u8; 6]]) -> Vec<&'a [u8; 6]> {
        table.iter().map(|&index| &backends[index]).collect()
    }

    #[test]
    fn every_slot_is_owned_and_the_spread_is_even() {
        let backends = backends(10);
        let table = table(&backends, DEFAULT_TABLE_SIZE);
        assert_eq!(table.len(), DEFAULT_TABLE_SIZE as usize);
        let mut counts = [0usize; 10];
        for &owner in &table {
            counts[owner] += 1;
        }
        // Turn-taking fills ⌊M/N⌋ or ⌈M/N⌉ slots per backend.
        assert!(counts.iter().all(|&count| count == 102 || count == 103), "{counts:?}");
    }

    #[test]
    fn the_table_does_not_depend_on_the_order_backends_are_listed() {
        let forward = backends(7);
        let mut reversed = forward.clone();
        reversed.reverse();
        assert_eq!(owners(&table(&forward, 251), &forward), owners(&table(&reversed, 251), &reversed));
    }

    #[test]
    fn removing_one_of_n_backends_moves_about_one_nth_of_the_slots() {
        // Maglev's bound holds for M ≫ N, so the table grows with the backends here.
        for (count, size) in [(5u8, 1021), (10, 1021), (50, 8191), (200, 32749)] {
            let before = backends(count);
            let after: Vec<[u8; 6]> = before[1..].to_vec();
            let old = owners(&table(&before, size), &before);
            let new = owners(&table(&after, size), &after);
            let moved = old.iter().zip(&new).filter(|(old, new)| old != new).count();
            let orphaned = old.iter().filter(|owner| ***owner == before[0]).count();
            // The removed backend's slots must move; Maglev moves a few others too.
            let share = moved as f64 / f64::from(size);
            let ideal = 1.0 / f64::from(count);
            assert!(moved >= orphaned);
            assert!(share < ideal * 1.5 + 0.01, "{count} backends: {share:.3} moved, ideal {ideal:.3}");
        }
    }

    #[test]
    fn adding_a_backend_moves_about_one_nth_of_the_slots() {
        let before = backends(9);
        let after = backends(10);
        let old = owners(&table(&before, DEFAULT_TABLE_SIZE), &before);
        let new = owners(&table(&after, DEFAULT_TABLE_SIZE), &after);
        let moved = old.iter().zip(&new).filter(|(old, new)| old != new).count();
        let share = moved as f64 / f64::from(DEFAULT_TABLE_SIZE);
        assert!(share < 0.1 * 1.5 + 0.01, "{share:.3} moved");
    }

    #[test]
    fn no_backends_or_no_slots_give_an_empty_table() {
        assert!(table::<[u8; 6]>(&[], 251).is_empty());
        assert!(table(&backends(3), 0).is_empty());
    }

    #[test]
    fn one_backend_owns_every_slot() {
        assert!(table(&backends(1), 251).iter().all(|&owner| owner == 0));
    }

    #[test]
    fn the_table_is_pinned_so_that_every_build_agrees() {
        // A change here changes every node's tables: a rolling upgrade would move flows.
        let table = table(&backends(3), 251);
        assert_eq!(table[..12], [0, 0, 2, 2, 1, 2, 0, 2, 2, 0, 2, 1], "change only on purpose");
    }
}
