//! A BPF map together with what vipr last wrote to it, synced by difference.
use std::collections::BTreeMap;

use aya::{
    maps::{lpm_trie, HashMap, LpmTrie, MapData, MapError},
    Pod,
};
use tracing::warn;

/// Insert and delete by a key vipr's planner uses; implemented for the aya map types whose
/// keys are shaped differently.
pub trait KeyedMap {
    type Key: Ord + Clone;
    type Value: Eq + Clone;

    fn put(&mut self, key: &Self::Key, value: &Self::Value) -> Result<(), MapError>;
    fn delete(&mut self, key: &Self::Key) -> Result<(), MapError>;
    fn entries(&self) -> Vec<(Self::Key, Self::Value)>;
    /// Writes `entries` in one batched update; false if the kernel refused it (or the map
    /// type has none here), and then they are written one by one.
    fn put_batch(&mut self, _entries: &[(&Self::Key, &Self::Value)]) -> bool {
        false
    }
}

impl<K: Pod + Ord, V: Pod + Eq> KeyedMap for HashMap<MapData, K, V> {
    type Key = K;
    type Value = V;

    fn put(&mut self, key: &K, value: &V) -> Result<(), MapError> {
        self.insert(key, value, 0)
    }

    fn delete(&mut self, key: &K) -> Result<(), MapError> {
        match self.remove(key) {
            Err(MapError::KeyNotFound) => Ok(()),
            other => other,
        }
    }

    fn entries(&self) -> Vec<(K, V)> {
        self.iter().filter_map(log_read_error).collect()
    }
}

impl<K: Pod + Ord, V: Pod + Eq> KeyedMap for LpmTrie<MapData, K, V> {
    type Key = (u32, K);
    type Value = V;

    fn put(&mut self, (prefix_len, data): &Self::Key, value: &V) -> Result<(), MapError> {
        self.insert(&lpm_trie::Key::new(*prefix_len, *data), value, 0)
    }

    fn delete(&mut self, (prefix_len, data): &Self::Key) -> Result<(), MapError> {
        match self.remove(&lpm_trie::Key::new(*prefix_len, *data)) {
            Err(MapError::KeyNotFound) => Ok(()),
            other => other,
        }
    }

    /// A sync from scratch adds a trie entry per cluster IP: 10k of them in one call.
    fn put_batch(&mut self, entries: &[(&Self::Key, &V)]) -> bool {
        use std::os::fd::AsFd as _;

        use aya::maps::IterableMap as _;
        let keys: Vec<lpm_trie::Key<K>> =
            entries.iter().map(|((prefix_len, data), _)| lpm_trie::Key::new(*prefix_len, *data)).collect();
        let values: Vec<V> = entries.iter().map(|(_, value)| **value).collect();
        // SAFETY: aya opened the trie with these key and value types, checking their sizes.
        unsafe { crate::bpf_sys::update_batch(self.map().fd().as_fd(), &keys, &values) }.is_ok()
    }

    fn entries(&self) -> Vec<(Self::Key, V)> {
        self.iter()
            .filter_map(log_read_error)
            .map(|(key, value)| ((key.prefix_len(), key.data()), value))
            .collect()
    }
}

pub fn log_read_error<T>(entry: Result<T, MapError>) -> Option<T> {
    entry.map_err(|error| warn!(%error, "cannot read a pinned map entry")).ok()
}

/// A map and its last written content, read back from the kernel when adopted.
pub struct Mirrored<M: KeyedMap> {
    pub map: M,
    content: BTreeMap<M::Key, M::Value>,
}

impl<M: KeyedMap> Mirrored<M> {
    pub fn adopt(map: M) -> Self {
        let content = map.entries().into_iter().collect();
        Self { map, content }
    }

    /// Writes what differs from `wanted`. Returns the number of entries changed and the
    /// failures; a failed entry keeps its old value and is retried by the next sync.
    /// New entries go in before stale ones go (a filter never passes through a state with
    /// neither); an entry a full map refuses is tried again once the stale ones made room.
    pub fn sync(&mut self, wanted: &BTreeMap<M::Key, M::Value>) -> (usize, Vec<String>) {
        let mut changed = 0;
        let mut failures = Vec::new();
        let mut refused = Vec::new();
        let new: Vec<(&M::Key, &M::Value)> =
            wanted.iter().filter(|(key, value)| self.content.get(*key) != Some(*value)).collect();
        if new.len() > 1 && self.map.put_batch(&new) {
            changed += new.len();
            self.content.extend(new.iter().map(|(key, value)| ((*key).clone(), (*value).clone())));
        }
        for (key, value) in new {
            if self.content.get(key) == Some(value) {
                continue;
            }
            match self.map.put(key, value) {
                Ok(()) => {
                    self.content.insert(key.clone(), value.clone());
                    changed += 1;
                }
                Err(_) => refused.push((key, value)),
            }
        }
        let stale: Vec<M::Key> =
            self.content.keys().filter(|key| !wanted.contains_key(key)).cloned().collect();
        for key in stale {
            match self.map.delete(&key) {
                Ok(()) => {
                    self.content.remove(&key);
                    changed += 1;
                }
                Err(error) => failures.push(error.to_string()),
            }
        }
        for (key, value) in refused {
            match self.map.put(key, value) {
                Ok(()) => {
                    self.content.insert(key.clone(), value.clone());
                    changed += 1;
                }
                Err(error) => failures.push(error.to_string()),
            }
        }
        (changed, failures)
    }
}
