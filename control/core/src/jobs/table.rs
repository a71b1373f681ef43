//! [`JobTable`]: every job by id, in hash maps whose growth never stalls the apply path.
//!
//! Every submission, transition and write-behind flush looks a job up by id. In an ordered
//! map of a million jobs a lookup took about 1.3 µs (a chain of 32-character ids compared
//! through cold memory); in a hash map about 0.2–0.5 µs. But one hash map doubles all at once:
//! at 917,504 jobs a single insert moved every job and took 566 ms, under the state lock that
//! every apply and read takes. So the jobs are spread over [`SHARDS`] hash maps by a keyed hash
//! of the id: a shard doubles alone, and the worst insert at a million jobs was 2.6 ms
//! (ADR 0038).

use std::collections::hash_map::{self, RandomState};
use std::collections::HashMap;
use std::hash::BuildHasher;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::Job;

/// Hash maps the jobs are spread over: a shard holds about 1/256 of the jobs, so its growth
/// moves that much at once.
pub const SHARDS: usize = 256;

/// Every job by id. Iteration order is unspecified: what needs an order keeps its own index.
#[derive(Debug, Clone)]
pub struct JobTable {
    /// Picks a job's shard; keyed per process, so ids cannot be chosen to fill one shard.
    hasher: RandomState,
    shards: Vec<HashMap<String, Job>>,
    len: usize,
}

impl Default for JobTable {
    fn default() -> Self {
        JobTable {
            hasher: RandomState::new(),
            // An empty map allocates nothing: a small cluster pays for 256 empty headers only.
            shards: (0..SHARDS).map(|_| HashMap::new()).collect(),
            len: 0,
        }
    }
}

impl JobTable {
    fn shard(&self, id: &str) -> usize {
        (self.hasher.hash_one(id) % SHARDS as u64) as usize
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, id: &str) -> Option<&Job> {
        self.shards[self.shard(id)].get(id)
    }

    pub fn get_mut(&mut self, id: &str) -> Option<&mut Job> {
        let s = self.shard(id);
        self.shards[s].get_mut(id)
    }

    /// Inserts `job` under `id`; returns the job it replaced.
    pub fn insert(&mut self, id: String, job: Job) -> Option<Job> {
        let s = self.shard(&id);
        let old = self.shards[s].insert(id, job);
        if old.is_none() {
            self.len += 1;
        }
        old
    }

    pub fn remove(&mut self, id: &str) -> Option<Job> {
        let s = self.shard(id);
        let old = self.shards[s].remove(id);
        if old.is_some() {
            self.len -= 1;
        }
        old
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Job)> {
        self.shards.iter().flat_map(HashMap::iter)
    }

    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.shards.iter().flat_map(HashMap::keys)
    }

    pub fn values(&self) -> impl Iterator<Item = &Job> {
        self.shards.iter().flat_map(HashMap::values)
    }
}

impl std::ops::Index<&str> for JobTable {
    type Output = Job;

    fn index(&self, id: &str) -> &Job {
        self.get(id).unwrap_or_else(|| panic!("no job {id} in the table"))
    }
}

impl<'a> IntoIterator for &'a JobTable {
    type Item = (&'a String, &'a Job);
    type IntoIter = std::iter::FlatMap<
        std::slice::Iter<'a, HashMap<String, Job>>,
        hash_map::Iter<'a, String, Job>,
        fn(&'a HashMap<String, Job>) -> hash_map::Iter<'a, String, Job>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.shards.iter().flat_map(HashMap::iter)
    }
}

impl FromIterator<(String, Job)> for JobTable {
    fn from_iter<I: IntoIterator<Item = (String, Job)>>(iter: I) -> Self {
        let mut t = JobTable::default();
        for (id, job) in iter {
            t.insert(id, job);
        }
        t
    }
}

impl PartialEq for JobTable {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().all(|(id, j)| other.get(id) == Some(j))
    }
}

impl Eq for JobTable {}

/// A map from id to job, in id order (as the ordered map this replaced wrote it).
impl Serialize for JobTable {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut all: Vec<(&String, &Job)> = self.iter().collect();
        all.sort_unstable_by(|a, b| a.0.cmp(b.0));
        s.collect_map(all)
    }
}

impl<'de> Deserialize<'de> for JobTable {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let all = std::collections::BTreeMap::<String, Job>::deserialize(d)?;
        Ok(all.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(id: &str) -> Job {
        serde_json::from_value(serde_json::json!({
            "id": id, "seq": 1, "tenant": "t", "model": "m", "class": "c", "body_sha256": "",
            "state": "queued", "attempts": 0, "max_attempts": 1, "submitted_ms": 0,
        }))
        .expect("a queued job")
    }

    #[test]
    fn a_table_counts_finds_and_forgets_jobs_across_its_shards() {
        let mut t = JobTable::default();
        for i in 0..2_000 {
            assert!(t.insert(format!("j{i}"), job(&format!("j{i}"))).is_none());
        }
        assert!(t.insert("j7".into(), job("j7")).is_some(), "a second insert replaces");
        assert_eq!(t.len(), 2_000);
        assert_eq!(t.iter().count(), 2_000);
        let used = t.shards.iter().filter(|s| !s.is_empty()).count();
        assert!(used > SHARDS / 2, "2,000 ids spread over {used} of {SHARDS} shards");
        assert_eq!(t.get("j1999").map(|j| j.id.as_str()), Some("j1999"));
        assert!(t.get("j2000").is_none());
        assert_eq!(t.remove("j5").map(|j| j.id), Some("j5".to_string()));
        assert!(t.remove("j5").is_none());
        assert_eq!(t.len(), 1_999);
        assert!(t.get("j5").is_none());
    }

    #[test]
    fn tables_with_the_same_jobs_are_equal_and_round_trip_through_json_in_id_order() {
        let a: JobTable = ["b", "a", "c"].iter().map(|id| (id.to_string(), job(id))).collect();
        let b: JobTable = ["c", "b", "a"].iter().map(|id| (id.to_string(), job(id))).collect();
        assert_eq!(a, b, "two tables key their shards differently and still compare equal");
        let text = serde_json::to_string(&a).unwrap();
        assert!(text.starts_with(r#"{"a":"#), "written in id order: {text}");
        let back: JobTable = serde_json::from_str(&text).unwrap();
        assert_eq!(back, a);
        let mut c = b.clone();
        c.remove("a");
        assert_ne!(a, c);
    }
}
