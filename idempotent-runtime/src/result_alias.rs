//! The compile-time check that an "infallible" handler's value is not a `Result`.
//!
//! The macro reads a handler's return type syntactically: `Result<T, E>` (or a
//! one-argument alias named `Result`) is fallible, anything else is the value of a
//! handler that cannot fail. A `Result` under another name (`type PayResult<T> =
//! Result<T, PayError>`) would then have its `Err` recorded as a success. The
//! expansion asks this module, by method resolution on the resolved type, whether the
//! value is a `Result`, and refuses to compile if it is.
//!
//! How: `(&ValueType::<V>::new()).probe()` finds [`ResultValue::probe`] without
//! auto-referencing when `V` is `Result<T, E>`, and [`AnyValue::probe`] (one
//! auto-reference further) for every other type. The first returns a
//! [`ResultUnderAnotherName`], which [`require_value`] rejects with the explanation.

use std::marker::PhantomData;

/// The handler's value type, carried only as a type.
pub struct ValueType<V>(PhantomData<V>);

impl<V> ValueType<V> {
    /// A probe for `V`.
    pub const fn new() -> Self {
        ValueType(PhantomData)
    }
}

impl<V> Default for ValueType<V> {
    fn default() -> Self {
        Self::new()
    }
}

/// What [`AnyValue::probe`] returns: the value is not a `Result`.
pub struct NotAResult;

/// What [`ResultValue::probe`] returns: the value is a `Result` the macro did not see.
pub struct ResultUnderAnotherName<V>(PhantomData<V>);

/// Chosen for `ValueType<Result<T, E>>`.
pub trait ResultValue {
    /// The value type.
    type Value;
    /// Says that the value is a `Result`.
    fn probe(&self) -> ResultUnderAnotherName<Self::Value>;
}

impl<T, E> ResultValue for ValueType<Result<T, E>> {
    type Value = Result<T, E>;
    fn probe(&self) -> ResultUnderAnotherName<Result<T, E>> {
        ResultUnderAnotherName(PhantomData)
    }
}

/// Chosen for every other value type.
pub trait AnyValue {
    /// Says that the value is not a `Result`.
    fn probe(&self) -> NotAResult;
}

impl<V> AnyValue for &ValueType<V> {
    fn probe(&self) -> NotAResult {
        NotAResult
    }
}

/// Implemented only by [`NotAResult`].
#[diagnostic::on_unimplemented(
    message = "this handler returns a `Result` under another name, so `#[idempotent]` would record its `Err` as a success",
    label = "a `Result` whose name is not `Result`",
    note = "write the return type as `Result<T, E>` (or a one-argument alias named `Result`, like `io::Result<T>`) so that errors are classified, retried and alerted",
    note = "to keep a `Result` as the value of a handler that cannot fail, wrap it in a struct"
)]
pub trait InfallibleValue {}

#[diagnostic::do_not_recommend]
impl InfallibleValue for NotAResult {}

/// Compiles only for [`NotAResult`].
pub fn require_value<P: InfallibleValue>(_: P) {}
