//! Sessions and their reports, kept in an embedded database (redb) under the state
//! directory so they survive daemon restarts. A session is stored when it starts (as running)
//! and again when it ends. The daemon writes through one thread, in the order it asks
//! ([`writer`]); stored reports are read by the RPCs that ask for them.
//!
//! Faults: a write that fails fails its operation. redb refuses every operation on a handle
//! that once saw an I/O error (a full disk), so the database is then reopened at its next use,
//! and works again once the disk has room. A damaged file is moved aside at start ([`damage`]).
//!
//! redb reuses the pages of deleted rows but never gives them back to the filesystem on its
//! own: deletes compact the file when most of it is free ([`Store::delete`]).

mod damage;
pub mod writer;

use std::path::{Path, PathBuf};

use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tracer_proto::SessionInfo;

/// The database's file name in the state directory.
const FILE: &str = "sessions.redb";
/// Session id → `SessionInfo`, protobuf-encoded.
const SESSIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("sessions");
/// Session id → the report as JSON (`report::Report`).
const REPORTS: TableDefinition<&str, &str> = TableDefinition::new("reports");
/// Files smaller than this are not worth compacting.
const COMPACT_ABOVE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot use state directory {dir}: {source}")]
    Dir {
        dir: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("state directory {dir} is in use by another tracerd")]
    InUse { dir: PathBuf },
    #[error("state database {path}: {source}")]
    Db {
        path: PathBuf,
        #[source]
        source: Box<redb::Error>,
    },
    #[error("cannot move the damaged state database {path} aside: {source}")]
    MoveAside {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("stored session {id} is corrupt: {source}")]
    Corrupt {
        id: String,
        #[source]
        source: prost::DecodeError,
    },
    #[error("a write to the state database failed unexpectedly (see tracerd's log)")]
    Panicked,
}

pub struct Store {
    /// None after an I/O error, until the next use reopens it.
    db: Option<Database>,
    path: PathBuf,
}

impl Store {
    pub fn open(dir: &Path) -> Result<Self, StoreError> {
        let dir_err = |source| StoreError::Dir {
            dir: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(dir_err)?;
        // Fail early and clearly on a directory we cannot write, before redb's own error.
        let probe = dir.join(".tracerd-write-test");
        std::fs::write(&probe, b"").map_err(dir_err)?;
        let _ = std::fs::remove_file(&probe);
        let path = dir.join(FILE);
        let db = match damage::open_checked(&path) {
            Ok(db) => db,
            Err(damage::Unusable::InUse) => {
                return Err(StoreError::InUse {
                    dir: dir.to_owned(),
                })
            }
            Err(damage::Unusable::Failed(e)) => {
                return Err(StoreError::Db {
                    path,
                    source: Box::new(e),
                })
            }
            Err(damage::Unusable::Damaged(why)) => damage::replace(&path, &why)?,
        };
        let mut store = Self { db: Some(db), path };
        // Create the tables so that reads of an empty store succeed.
        store.write(|_, _| Ok(()))?;
        Ok(store)
    }

    fn db_err(&self, e: impl Into<redb::Error>) -> StoreError {
        StoreError::Db {
            path: self.path.clone(),
            source: Box::new(e.into()),
        }
    }

    /// Runs `op` on the database, opening it again first if an I/O error closed it.
    fn with_db<T>(
        &mut self,
        op: impl FnOnce(&Database) -> Result<T, redb::Error>,
    ) -> Result<T, StoreError> {
        if self.db.is_none() {
            let db = Database::create(&self.path).map_err(|e| self.db_err(e))?;
            tracing::info!(path = %self.path.display(), "state database reopened");
            self.db = Some(db);
        }
        let result = op(self.db.as_ref().expect("opened above"));
        result.map_err(|e| {
            if matches!(e, redb::Error::Io(_) | redb::Error::PreviousIo) {
                // The handle is poisoned for good; a new one recovers from the last commit.
                self.db = None;
            }
            self.db_err(e)
        })
    }

    fn write(
        &mut self,
        f: impl FnOnce(
            &mut redb::Table<&str, &[u8]>,
            &mut redb::Table<&str, &str>,
        ) -> Result<(), redb::Error>,
    ) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write()?;
            {
                let mut sessions = txn.open_table(SESSIONS)?;
                let mut reports = txn.open_table(REPORTS)?;
                f(&mut sessions, &mut reports)?;
            }
            txn.commit()?;
            Ok(())
        })
    }

    /// Records a session and its report (so far), durably.
    pub fn put(&mut self, info: &SessionInfo, report_json: &str) -> Result<(), StoreError> {
        let bytes = info.encode_to_vec();
        self.write(|sessions, reports| {
            sessions.insert(info.id.as_str(), bytes.as_slice())?;
            reports.insert(info.id.as_str(), report_json)?;
            Ok(())
        })
    }

    /// Forgets a session and its report, and compacts the file when most of it is free.
    pub fn delete(&mut self, id: &str) -> Result<(), StoreError> {
        self.write(|sessions, reports| {
            sessions.remove(id)?;
            reports.remove(id)?;
            Ok(())
        })?;
        // The delete is done: a compaction that fails only leaves the file as large as it was.
        if let Err(e) = self.compact_if_mostly_free() {
            tracing::warn!(%e, "compacting the state database");
        }
        Ok(())
    }

    /// Compacts the file when less than half of it holds data. Returns whether it did.
    fn compact_if_mostly_free(&mut self) -> Result<bool, StoreError> {
        let file = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if file < COMPACT_ABOVE {
            return Ok(false);
        }
        let used = self.with_db(|db| {
            let txn = db.begin_write()?;
            let stats = txn.stats()?;
            txn.abort()?;
            Ok(stats.allocated_pages() * stats.page_size() as u64)
        })?;
        if used * 2 > file {
            return Ok(false);
        }
        // The manager owns the store and runs one operation at a time: no transaction is open.
        let mut db = self.db.take().expect("with_db opened it");
        let result = (|| {
            // Each pass moves pages towards the start; a few are enough to reach the end.
            for _ in 0..8 {
                if !db.compact()? {
                    break;
                }
            }
            Ok(())
        })();
        self.db = Some(db);
        result.map_err(|e: redb::CompactionError| self.db_err(e))?;
        let after = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        tracing::info!(before = file, after, "state database compacted");
        Ok(true)
    }

    /// Every stored session.
    pub fn sessions(&mut self) -> Result<Vec<SessionInfo>, StoreError> {
        let rows = self.with_db(|db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(SESSIONS)?;
            let mut rows = Vec::new();
            for row in table.iter()? {
                let (id, bytes) = row?;
                rows.push((id.value().to_owned(), bytes.value().to_vec()));
            }
            Ok(rows)
        })?;
        rows.into_iter()
            .map(|(id, bytes)| {
                SessionInfo::decode(bytes.as_slice())
                    .map_err(|source| StoreError::Corrupt { id, source })
            })
            .collect()
    }

    pub fn report(&mut self, id: &str) -> Result<Option<String>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read()?;
            let table = txn.open_table(REPORTS)?;
            Ok(table.get(id)?.map(|v| v.value().to_owned()))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(id: &str) -> SessionInfo {
        SessionInfo {
            id: id.into(),
            elapsed_ms: 42,
            ..Default::default()
        }
    }

    #[test]
    fn sessions_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let info = session("abc");
        {
            let mut store = Store::open(dir.path()).unwrap();
            store.put(&info, "{\"x\":1}").unwrap();
            assert!(matches!(
                Store::open(dir.path()),
                Err(StoreError::InUse { .. })
            ));
        }
        let mut store = Store::open(dir.path()).unwrap();
        assert_eq!(store.sessions().unwrap(), vec![info]);
        assert_eq!(store.report("abc").unwrap().as_deref(), Some("{\"x\":1}"));
        assert_eq!(store.report("nope").unwrap(), None);
        assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| !e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains("damaged")));
    }

    /// Deleting most of what a large file holds gives the space back to the filesystem.
    #[test]
    fn deletes_compact_a_mostly_free_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        let report = format!("{{\"pad\":\"{}\"}}", "x".repeat(200 * 1024));
        for i in 0..40 {
            store.put(&session(&format!("s{i:02}")), &report).unwrap();
        }
        let size = || std::fs::metadata(dir.path().join(FILE)).unwrap().len();
        let full = size();
        assert!(full > 8 * COMPACT_ABOVE, "{full}");
        // The newest stays: its pages at the end of the file keep redb from shrinking it.
        for i in 0..39 {
            store.delete(&format!("s{i:02}")).unwrap();
        }
        let after = size();
        assert!(
            after < full / 4,
            "{full} bytes before the deletes, {after} after"
        );
        assert_eq!(store.sessions().unwrap(), vec![session("s39")]);
        assert_eq!(store.report("s39").unwrap(), Some(report));
        // Writes go on after a compaction, and the file reopens.
        store.put(&session("new"), "{}").unwrap();
        drop(store);
        assert_eq!(
            Store::open(dir.path()).unwrap().sessions().unwrap().len(),
            2
        );
    }

    #[test]
    fn a_file_is_not_a_state_directory() {
        let file = tempfile::NamedTempFile::new().unwrap();
        let err = Store::open(&file.path().join("state")).err().unwrap();
        assert!(
            err.to_string().starts_with("cannot use state directory"),
            "{err}"
        );
    }

    /// A file that is not a database at all is moved aside, and a fresh one used.
    #[test]
    fn garbage_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(FILE), vec![0x5a; 3 * 4096]).unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        assert_eq!(store.sessions().unwrap(), vec![]);
        let aside: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("sessions.redb.damaged-"))
            .collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
    }

    /// Damage anywhere never keeps the store from opening; undamaged stores keep every row.
    #[test]
    fn damaged_blocks_never_keep_the_store_from_opening() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for round in 0..24 {
            let dir = tempfile::tempdir().unwrap();
            {
                let mut store = Store::open(dir.path()).unwrap();
                for i in 0..40 {
                    let report = format!("{{\"n\":{i},\"pad\":\"{}\"}}", "x".repeat(900));
                    store.put(&session(&format!("s{i:02}")), &report).unwrap();
                }
            }
            let path = dir.path().join(FILE);
            let mut bytes = std::fs::read(&path).unwrap();
            let blocks = bytes.len() / 4096;
            for _ in 0..=(round % 4) {
                let b = (next() as usize) % blocks;
                for byte in &mut bytes[b * 4096..(b + 1) * 4096] {
                    *byte = next() as u8;
                }
            }
            std::fs::write(&path, &bytes).unwrap();
            let mut store = Store::open(dir.path()).unwrap();
            let kept = store.sessions().unwrap();
            assert!(kept.len() <= 40);
            for s in &kept {
                assert!(store.report(&s.id).is_ok());
            }
            // The fresh store takes writes.
            store.put(&session("new"), "{}").unwrap();
        }
    }
}
