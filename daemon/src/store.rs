//! Finished sessions and their reports, kept in an embedded database (redb) under the state
//! directory so they survive daemon restarts.

use std::path::{Path, PathBuf};

use prost::Message;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use tracer_proto::SessionInfo;

/// Session id → `SessionInfo`, protobuf-encoded.
const SESSIONS: TableDefinition<&str, &[u8]> = TableDefinition::new("sessions");
/// Session id → the report as JSON (`report::Report`).
const REPORTS: TableDefinition<&str, &str> = TableDefinition::new("reports");

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
    #[error("stored session {id} is corrupt: {source}")]
    Corrupt {
        id: String,
        #[source]
        source: prost::DecodeError,
    },
}

pub struct Store {
    db: Database,
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
        let path = dir.join("sessions.redb");
        let db = Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => StoreError::InUse {
                dir: dir.to_owned(),
            },
            e => StoreError::Db {
                path: path.clone(),
                source: Box::new(e.into()),
            },
        })?;
        let store = Self { db, path };
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

    fn write(
        &self,
        f: impl FnOnce(
            &mut redb::Table<&str, &[u8]>,
            &mut redb::Table<&str, &str>,
        ) -> Result<(), redb::Error>,
    ) -> Result<(), StoreError> {
        let txn = self.db.begin_write().map_err(|e| self.db_err(e))?;
        {
            let mut sessions = txn.open_table(SESSIONS).map_err(|e| self.db_err(e))?;
            let mut reports = txn.open_table(REPORTS).map_err(|e| self.db_err(e))?;
            f(&mut sessions, &mut reports).map_err(|e| self.db_err(e))?;
        }
        txn.commit().map_err(|e| self.db_err(e))
    }

    /// Records a finished session and its report, durably.
    pub fn put(&self, info: &SessionInfo, report_json: &str) -> Result<(), StoreError> {
        let bytes = info.encode_to_vec();
        self.write(|sessions, reports| {
            sessions.insert(info.id.as_str(), bytes.as_slice())?;
            reports.insert(info.id.as_str(), report_json)?;
            Ok(())
        })
    }

    /// Forgets a session and its report.
    pub fn delete(&self, id: &str) -> Result<(), StoreError> {
        self.write(|sessions, reports| {
            sessions.remove(id)?;
            reports.remove(id)?;
            Ok(())
        })
    }

    /// Every stored session.
    pub fn sessions(&self) -> Result<Vec<SessionInfo>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.db_err(e))?;
        let table = txn.open_table(SESSIONS).map_err(|e| self.db_err(e))?;
        let mut out = Vec::new();
        for row in table.iter().map_err(|e| self.db_err(e))? {
            let (id, bytes) = row.map_err(|e| self.db_err(e))?;
            let info =
                SessionInfo::decode(bytes.value()).map_err(|source| StoreError::Corrupt {
                    id: id.value().to_owned(),
                    source,
                })?;
            out.push(info);
        }
        Ok(out)
    }

    pub fn report(&self, id: &str) -> Result<Option<String>, StoreError> {
        let txn = self.db.begin_read().map_err(|e| self.db_err(e))?;
        let table = txn.open_table(REPORTS).map_err(|e| self.db_err(e))?;
        Ok(table
            .get(id)
            .map_err(|e| self.db_err(e))?
            .map(|v| v.value().to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_survive_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let info = SessionInfo {
            id: "abc".into(),
            elapsed_ms: 42,
            ..Default::default()
        };
        {
            let store = Store::open(dir.path()).unwrap();
            store.put(&info, "{\"x\":1}").unwrap();
            assert!(matches!(
                Store::open(dir.path()),
                Err(StoreError::InUse { .. })
            ));
        }
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.sessions().unwrap(), vec![info]);
        assert_eq!(store.report("abc").unwrap().as_deref(), Some("{\"x\":1}"));
        assert_eq!(store.report("nope").unwrap(), None);
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
}
