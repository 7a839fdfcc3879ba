//! A table that holds each distinct entry once, numbered in the order entries are first
//! asked for: pprof's and OTLP's string, function, location, stack and attribute tables,
//! which samples refer to by index.

use std::{borrow::Borrow, collections::HashMap, hash::Hash};

pub(crate) struct Table<K, T> {
    items: Vec<T>,
    ids: HashMap<K, usize>,
}

impl<K: Hash + Eq, T> Table<K, T> {
    /// A table starting with `reserved`: entries no key names, such as OTLP's empty entry
    /// at index 0 of its function, location and stack tables (a string table's "" is a key:
    /// add it with [`Self::string`] first).
    pub(crate) fn new(reserved: Vec<T>) -> Self {
        Self {
            items: reserved,
            ids: HashMap::new(),
        }
    }

    /// The index of `key`'s entry, made by `make` the first time.
    pub(crate) fn id<Q>(&mut self, key: &Q, make: impl FnOnce(&K) -> T) -> usize
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ToOwned<Owned = K> + ?Sized,
    {
        if let Some(&id) = self.ids.get(key) {
            return id;
        }
        let key = key.to_owned();
        let id = self.items.len();
        self.items.push(make(&key));
        self.ids.insert(key, id);
        id
    }

    /// The index of `key`'s entry, if there is one: with [`Self::push`], for entries whose
    /// making needs the caller's other tables.
    pub(crate) fn get<Q>(&self, key: &Q) -> Option<usize>
    where
        K: Borrow<Q>,
        Q: Hash + Eq + ?Sized,
    {
        self.ids.get(key).copied()
    }

    /// Adds `item` as `key`'s entry (which [`Self::get`] found none for).
    pub(crate) fn push(&mut self, key: K, item: T) -> usize {
        let id = self.items.len();
        self.items.push(item);
        self.ids.insert(key, id);
        id
    }

    pub(crate) fn len(&self) -> usize {
        self.items.len()
    }

    pub(crate) fn into_items(self) -> Vec<T> {
        self.items
    }
}

impl<T> Table<String, T> {
    /// A string table's index of `s` (the entry is the string itself).
    pub(crate) fn string(&mut self, s: &str) -> usize
    where
        T: From<String>,
    {
        self.id(s, |k| T::from(k.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_entry_once_in_first_use_order_after_the_reserved() {
        let mut t: Table<String, String> = Table::new(vec![String::new()]);
        assert_eq!([t.string("b"), t.string("a"), t.string("b")], [1, 2, 1]);
        let mut made = 0;
        let mut pairs: Table<(i32, i32), String> = Table::new(Vec::new());
        for k in [(1, 2), (3, 4), (1, 2)] {
            pairs.id(&k, |k| {
                made += 1;
                format!("{k:?}")
            });
        }
        assert_eq!((made, pairs.len()), (2, 2));
        assert_eq!(t.into_items(), ["", "b", "a"]);
    }
}
