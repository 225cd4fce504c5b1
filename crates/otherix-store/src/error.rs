//! Store errors, saying whether the caller asked for something impossible
//! (not found, exists, in use, exhausted) or the database failed.

use otherix_core::ipam::IpamError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("{kind} {name:?} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("{kind} {name:?} already exists")]
    AlreadyExists { kind: &'static str, name: String },
    /// The operation conflicts with other objects (e.g. a network still in use).
    #[error("{0}")]
    Conflict(String),
    #[error(transparent)]
    Exhausted(#[from] IpamError),
    /// The request names something invalid (checked inside a transaction).
    #[error("{0}")]
    Invalid(String),
    /// Stored data the code cannot read: a bug or a hand-edited database.
    #[error("corrupt store: {0}")]
    Corrupt(String),
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    #[error(
        "the database has schema version {found}, newer than this otherix knows ({known}); upgrade otherix"
    )]
    TooNew { found: i64, known: i64 },
}

/// True when `e` is a UNIQUE or PRIMARY KEY violation.
pub(crate) fn is_unique_violation(e: &StoreError) -> bool {
    matches!(e, StoreError::Db(sqlx::Error::Database(d)) if d.is_unique_violation())
}

impl From<otherix_proto::UnknownWord> for StoreError {
    /// A stored word (a role, a state, an action) the code does not know.
    fn from(e: otherix_proto::UnknownWord) -> StoreError {
        StoreError::Corrupt(e.to_string())
    }
}
