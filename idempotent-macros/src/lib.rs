//! The procedural macros of the [`idempotent`](https://docs.rs/idempotent) crate:
//! `#[idempotent(...)]` and `#[derive(Classify)]`. Use them through `idempotent`,
//! whose documentation describes every argument; this crate only parses, checks and
//! generates a call into `idempotent::__private`.
//!
//! Layout: `args.rs` collects the attribute's arguments, `template.rs` parses key
//! templates, `async_trait.rs` recognises methods `#[async_trait]` has rewritten, `expand.rs` checks the whole and writes the function, `classify.rs`
//! derives `Classify`.

#![deny(missing_docs)]

mod args;
mod async_trait;
mod classify;
mod expand;
mod template;

use proc_macro::TokenStream;

/// Makes an `async fn` message handler idempotent. See the `idempotent` crate.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}

/// Implements `idempotent::Classify` from `#[idempotent(retryable)]` /
/// `#[idempotent(terminal)]` marks. See the `idempotent` crate.
#[proc_macro_derive(Classify, attributes(idempotent))]
pub fn derive_classify(item: TokenStream) -> TokenStream {
    classify::derive(item.into()).into()
}
