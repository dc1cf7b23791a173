//! Record formats across versions of this library.
//!
//! Consumers of two versions can share a store: during a rolling upgrade, or after a
//! rollback. Each store's records therefore follow two rules.
//!
//! * **Older records are read.** A version reads every format an earlier version
//!   wrote, and replaces it with its own at the next claim. (Redis records of the
//!   first format, `"<state> <attempts> <lease deadline ms> <token> ..."`, are read
//!   this way.)
//! * **Newer records are left alone, and their messages retried.** A record this
//!   version can't read because a later version wrote it is never overwritten,
//!   released or taken for absent. A claim on it fails with
//!   [`StoreError::NewerFormat`](crate::StoreError::NewerFormat), whose disposition is
//!   retry: the message comes back until a consumer of the newer version takes it, or
//!   the record expires. A transition (complete, release, fail, renew) answers
//!   [`LeaseLost`](crate::Transition::LeaseLost): the record is no longer this
//!   claim's. The [admin](super::admin) operations leave it out of listings and
//!   counts, name it on `inspect`, and release it only with `force`.
//!
//! How a later format is told apart from another program's data, which is
//! dead-lettered instead ([`StoreError::Rejected`](crate::StoreError::Rejected)):
//!
//! * Redis and ZooKeeper records are byte strings that start with their state letter
//!   (`P`, `R`, `D`, `F`). A later format starts with [`NEWER_MARK`] and its number,
//!   counted per store: this version writes Redis's second format and ZooKeeper's
//!   first, so theirs will start `#3 ` and `#2 `.
//! * PostgreSQL and MySQL rows hold their state in a one-letter column. A later format
//!   uses a letter other than `P`, `R`, `D` and `F` (columns it adds are ignored).

/// The first byte of a record in a format later than this version's, followed by the
/// format's number.
pub const NEWER_MARK: u8 = b'#';

/// What a record in a later format is, for [`StoreError::NewerFormat`]: `Some("record
/// format 2")` for `#2 ...`. `None` for a record that does not start with
/// [`NEWER_MARK`].
///
/// [`StoreError::NewerFormat`]: crate::StoreError::NewerFormat
#[cfg_attr(not(any(feature = "redis", feature = "zookeeper")), allow(dead_code))]
pub(crate) fn newer(record: &[u8]) -> Option<String> {
    let rest = record.strip_prefix(&[NEWER_MARK])?;
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    Some(match std::str::from_utf8(&rest[..digits.min(9)]) {
        Ok(number) if !number.is_empty() => format!("record format {number}"),
        _ => "a record format of a later version".to_owned(),
    })
}

/// What a state letter this version does not know is, for
/// [`StoreError::NewerFormat`](crate::StoreError::NewerFormat).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn newer_state(letter: &[u8]) -> String {
    format!("a record in state '{}', which this version does not know", letter.escape_ascii())
}

/// Why an operator's release (without force) leaves a later version's record.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn newer_refusal(letter: u8) -> String {
    format!("{}, written by a newer version: pass force to delete it", newer_state(&[letter]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn later_formats_are_named_by_their_number() {
        assert_eq!(newer(b"#2 P0 1 2 - ").as_deref(), Some("record format 2"));
        assert_eq!(newer(b"#12345678901234567890").as_deref(), Some("record format 123456789"));
        assert_eq!(newer(b"#").as_deref(), Some("a record format of a later version"));
        assert_eq!(newer(b"#x").as_deref(), Some("a record format of a later version"));
        for this_version in [&b"P0123 1 1 - "[..], b"D- 0 1 - result", b"", b"2#"] {
            assert_eq!(newer(this_version), None);
        }
    }
}
