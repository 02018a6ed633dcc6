//! A small slab: values in reused slots under stable keys, for what is in
//! flight (a ring's jobs and operations, an export's pending requests) where
//! the key travels as an SQE's user data or a request's tag.

pub struct Slab<T> {
    slots: Vec<Option<T>>,
    free: Vec<usize>,
    live: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Slab { slots: Vec::new(), free: Vec::new(), live: 0 }
    }
}

impl<T> Slab<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `v`; its key stays valid until [`Slab::remove`].
    pub fn insert(&mut self, v: T) -> usize {
        self.live += 1;
        match self.free.pop() {
            Some(k) => {
                self.slots[k] = Some(v);
                k
            }
            None => {
                self.slots.push(Some(v));
                self.slots.len() - 1
            }
        }
    }

    /// The value under `k`, if `k` is live.
    pub fn get_mut(&mut self, k: usize) -> Option<&mut T> {
        self.slots.get_mut(k)?.as_mut()
    }

    /// Takes the value under `k` out, freeing the key; None if `k` is not live.
    pub fn remove(&mut self, k: usize) -> Option<T> {
        let v = self.slots.get_mut(k)?.take()?;
        self.free.push(k);
        self.live -= 1;
        Some(v)
    }

    /// Takes every value out, freeing every key.
    pub fn drain(&mut self) -> impl Iterator<Item = T> + '_ {
        self.free.clear();
        self.live = 0;
        self.slots.drain(..).flatten()
    }

    /// Every live key and its value.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &T)> + '_ {
        self.slots.iter().enumerate().filter_map(|(k, v)| Some((k, v.as_ref()?)))
    }

    /// Every live key and its value, mutably.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (usize, &mut T)> + '_ {
        self.slots.iter_mut().enumerate().filter_map(|(k, v)| Some((k, v.as_mut()?)))
    }

    /// Values stored.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }
}

/// The value under a key the caller knows is live; panics otherwise.
impl<T> std::ops::Index<usize> for Slab<T> {
    type Output = T;
    fn index(&self, k: usize) -> &T {
        self.slots[k].as_ref().expect("a live slab key")
    }
}

impl<T> std::ops::IndexMut<usize> for Slab<T> {
    fn index_mut(&mut self, k: usize) -> &mut T {
        self.slots[k].as_mut().expect("a live slab key")
    }
}

#[cfg(test)]
mod tests {
    use super::Slab;

    #[test]
    fn keys_are_stable_and_reused() {
        let mut s = Slab::new();
        let (a, b) = (s.insert("a"), s.insert("b"));
        assert_eq!((s[a], s[b], s.len()), ("a", "b", 2));
        assert_eq!(s.remove(a), Some("a"));
        assert_eq!(s.remove(a), None, "a key is removed once");
        assert!(s.get_mut(a).is_none() && s.get_mut(99).is_none());
        assert_eq!(s.insert("c"), a, "a freed key is reused");
        *s.get_mut(b).unwrap() = "B";
        assert_eq!((s[a], s[b], s.len()), ("c", "B", 2));
        let mut all: Vec<_> = s.drain().collect();
        all.sort();
        assert_eq!((all, s.len()), (vec!["B", "c"], 0));
        assert_eq!(s.insert("d"), 0, "keys start again from nothing");
    }
}
