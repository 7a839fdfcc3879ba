//! A damaged database file (overwritten blocks, a bad disk): found at open, moved aside, and
//! what can still be read kept in a fresh one. redb may panic on a file damaged behind its
//! back, so opening and reading are done under `catch_unwind`.

use std::{
    cell::{Cell, RefCell},
    mem::ManuallyDrop,
    panic::{catch_unwind, AssertUnwindSafe},
    path::{Path, PathBuf},
};

use prost::Message;
use redb::{Builder, Database, DatabaseError, ReadableDatabase, ReadableTable, StorageError};
use tracer_proto::SessionInfo;

use super::{StoreError, REPORTS, SESSIONS};

/// Why the database cannot be used as it is.
pub(super) enum Unusable {
    /// Another tracerd has it open.
    InUse,
    /// Not the file's fault (permissions, I/O): it stays where it is.
    Failed(redb::Error),
    /// The file is damaged.
    Damaged(String),
}

/// Opens the database and reads every row, checked: a damaged file is reported, never a panic.
pub(super) fn open_checked(path: &Path) -> Result<Database, Unusable> {
    match open(path, true) {
        // The check commits what it repairs: on a full disk, open without it.
        Err(Unusable::Failed(redb::Error::Io(_))) => open(path, false),
        other => other,
    }
}

fn open(path: &Path, check: bool) -> Result<Database, Unusable> {
    quietly(|| {
        let db = Builder::new()
            .set_check_integrity_on_open(check)
            .create(path)
            .map_err(|e| match e {
                DatabaseError::DatabaseAlreadyOpen => Unusable::InUse,
                // redb says "not a redb database" as an I/O error of this kind.
                DatabaseError::Storage(StorageError::Io(e))
                    if e.kind() != std::io::ErrorKind::InvalidData =>
                {
                    Unusable::Failed(e.into())
                }
                e => Unusable::Damaged(e.to_string()),
            })?;
        // Not dropped if reading panics: closing a damaged file could panic again, mid-unwind.
        let db = ManuallyDrop::new(db);
        let mut rows = Rows::default();
        let read = rows.read(&db);
        let db = ManuallyDrop::into_inner(db);
        read.map(|()| db).map_err(Unusable::Damaged)
    })
    .unwrap_or_else(|why| Err(Unusable::Damaged(why)))
}

/// Moves the damaged file at `path` aside and puts a fresh database in its place, with the
/// rows that could be read from the damaged one.
pub(super) fn replace(path: &Path, why: &str) -> Result<Database, StoreError> {
    let aside = path.with_file_name(format!(
        "{}.damaged-{}",
        super::FILE,
        crate::clock::unix_ms() / 1000
    ));
    std::fs::rename(path, &aside).map_err(|source| StoreError::MoveAside {
        path: path.to_owned(),
        source,
    })?;
    let rows = salvage(&aside);
    let db_err = |e: redb::Error| StoreError::Db {
        path: path.to_owned(),
        source: Box::new(e),
    };
    let db = Database::create(path).map_err(|e| db_err(e.into()))?;
    let write = || -> Result<(), redb::Error> {
        let txn = db.begin_write()?;
        {
            let mut sessions = txn.open_table(SESSIONS)?;
            let mut reports = txn.open_table(REPORTS)?;
            for (id, bytes) in &rows.sessions {
                sessions.insert(id.as_str(), bytes.as_slice())?;
            }
            for (id, json) in rows.reports.iter().filter(|(id, _)| rows.has(id)) {
                reports.insert(id.as_str(), json.as_str())?;
            }
        }
        txn.commit()?;
        Ok(())
    };
    write().map_err(db_err)?;
    let why = why.lines().next().unwrap_or_default();
    tracing::warn!(
        "state database is damaged ({why}): moved it to {} and kept the {} sessions that could be read",
        aside.display(),
        rows.sessions.len()
    );
    Ok(db)
}

/// The rows of a damaged file that can be read, from a copy of it (opening may repair, and
/// the damaged file is kept as it was).
fn salvage(damaged: &Path) -> Rows {
    let copy: PathBuf = damaged.with_extension("salvage");
    let mut rows = Rows::default();
    if std::fs::copy(damaged, &copy).is_ok() {
        let _ = quietly(|| {
            if let Ok(db) = Database::create(&copy) {
                let db = ManuallyDrop::new(db);
                // Rows read before a failure are kept.
                let _ = rows.read(&db);
                drop(ManuallyDrop::into_inner(db));
            }
        });
    }
    let _ = std::fs::remove_file(&copy);
    rows
}

/// Rows read from a database, each checked: sessions decode, reports are JSON.
#[derive(Default)]
struct Rows {
    sessions: Vec<(String, Vec<u8>)>,
    reports: Vec<(String, String)>,
}

impl Rows {
    fn has(&self, id: &str) -> bool {
        self.sessions.iter().any(|(s, _)| s == id)
    }

    /// Reads every row, stopping at the first that cannot be read.
    fn read(&mut self, db: &Database) -> Result<(), String> {
        let txn = db.begin_read().map_err(|e| e.to_string())?;
        match txn.open_table(SESSIONS) {
            Ok(table) => {
                for row in table.iter().map_err(|e| e.to_string())? {
                    let (id, bytes) = row.map_err(|e| e.to_string())?;
                    let id = id.value().to_owned();
                    SessionInfo::decode(bytes.value()).map_err(|e| format!("session {id}: {e}"))?;
                    self.sessions.push((id, bytes.value().to_vec()));
                }
            }
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(e.to_string()),
        }
        match txn.open_table(REPORTS) {
            Ok(table) => {
                for row in table.iter().map_err(|e| e.to_string())? {
                    let (id, json) = row.map_err(|e| e.to_string())?;
                    let id = id.value().to_owned();
                    serde_json::from_str::<serde::de::IgnoredAny>(json.value())
                        .map_err(|e| format!("report of {id}: {e}"))?;
                    self.reports.push((id, json.value().to_owned()));
                }
            }
            Err(redb::TableError::TableDoesNotExist(_)) => {}
            Err(e) => return Err(e.to_string()),
        }
        Ok(())
    }
}

thread_local! {
    static QUIET: Cell<bool> = const { Cell::new(false) };
    static CAUGHT: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `f`, turning a panic into an error with its message. The panic is not printed: the
/// caller says in one line what it means.
fn quietly<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if QUIET.get() {
                let payload = info.payload();
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                CAUGHT.set(Some(format!("redb panicked: {msg}")));
            } else {
                previous(info);
            }
        }));
    });
    QUIET.set(true);
    let result = catch_unwind(AssertUnwindSafe(f));
    QUIET.set(false);
    result.map_err(|_| CAUGHT.take().unwrap_or_else(|| "redb panicked".into()))
}
