//! How the expansion has rustc report a wrong key field or `key_fn` once, on the
//! user's token, in words about the key.
//!
//! ## Fields without `Display`
//!
//! When every placeholder of a key template is a plain name (`"order:{order_id}"`),
//! the expansion binds each name to its value and passes the template itself to
//! `format_args!` in code that never runs ([`check_display`]). rustc reads the
//! template's source and reports a value without `Display` at its placeholder inside
//! the string, as it does for `println!`.
//!
//! The key is then built field by field through `(&Shown(&value)).put(&mut key, ..)`,
//! which resolves to [`DisplayField::put`] (the real [`KeyBuilder::field`]) when the
//! value is `Display`, and otherwise, one auto-reference further, to
//! [`UncheckedField::put`], which compiles without a second error. The expansion only
//! writes `Shown` beside such a check, so `UncheckedField::put` is never part of a
//! program that compiles; should it ever run, it fails the key rather than leave the
//! field out.
//!
//! ## `key_fn`
//!
//! The expansion calls `KeyFn::key(path, &message)` at the path's span. A function of
//! another shape (one that takes the message by value, say) fails [`KeyFn`] there,
//! with its message rather than a type mismatch inside the expansion.

use std::fmt::{self, Display};

use crate::KeyBuilder;
use crate::error::KeyError;

/// Takes the checked template; called only in code that never runs.
pub fn check_display(_: fmt::Arguments<'_>) {}

/// A key field's value, for [`DisplayField`] or [`UncheckedField`].
pub struct Shown<'a, T: ?Sized>(pub &'a T);

/// Chosen when the value is `Display`.
pub trait DisplayField {
    /// Appends the value, as [`KeyBuilder::field`].
    fn put(&self, key: &mut KeyBuilder, placeholder: &'static str);
}

impl<T: Display + ?Sized> DisplayField for Shown<'_, T> {
    fn put(&self, key: &mut KeyBuilder, placeholder: &'static str) {
        key.field(placeholder, self.0);
    }
}

/// Chosen otherwise, beside a `format_args!` check that fails to compile.
pub trait UncheckedField {
    /// Fails the key.
    fn put(&self, key: &mut KeyBuilder, placeholder: &'static str);
}

impl<T: ?Sized> UncheckedField for &Shown<'_, T> {
    fn put(&self, key: &mut KeyBuilder, placeholder: &'static str) {
        key.fail(KeyError::Unprintable { placeholder });
    }
}

/// A `key_fn`: a function of the message's reference to something `Display`.
#[diagnostic::on_unimplemented(
    message = "`key_fn` takes `fn(&{M}) -> impl Display`: `{Self}` doesn't fit",
    label = "not a `fn(&{M}) -> impl Display`",
    note = "write the function as `fn key(msg: &{M}) -> impl std::fmt::Display` (it borrows the message; the handler still gets it)"
)]
pub trait KeyFn<M: ?Sized> {
    /// What the function returns.
    type Key: Display;
    /// Calls the function.
    fn key(self, message: &M) -> Self::Key;
}

#[diagnostic::do_not_recommend]
impl<M: ?Sized, F, K> KeyFn<M> for F
where
    F: FnOnce(&M) -> K,
    K: Display,
{
    type Key = K;
    fn key(self, message: &M) -> K {
        self(message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Opaque;

    #[test]
    #[allow(clippy::needless_borrow)] // the borrow picks the method, as in the expansion
    fn a_display_value_is_appended_and_any_other_fails_the_key() {
        let mut key = KeyBuilder::new("ns");
        key.text("k:");
        (&Shown(&7u8)).put(&mut key, "n");
        assert_eq!(key.finish().unwrap(), crate::Key::new("ns", "k:7").unwrap());

        let mut key = KeyBuilder::new("ns");
        key.text("k:");
        (&Shown(&Opaque)).put(&mut key, "opaque");
        assert!(matches!(key.finish(), Err(KeyError::Unprintable { placeholder: "opaque" })));
    }
}
