//! Methods that `#[async_trait]` has already rewritten.
//!
//! On an `#[async_trait]` impl, that attribute runs first and turns
//! `async fn handle(&self, msg: &M) -> R { body }` into
//! `fn handle<'life0, ..>(&'life0 self, ..) -> Pin<Box<dyn Future<Output = R> + Send + 'async_trait>>`
//! with the body `Box::pin(async move { .. body .. })`. Like `tracing`'s
//! `#[instrument]`, `#[idempotent]` recognises that shape, checks the method as the user
//! wrote it (`async fn .. -> R`), and wraps the inner `async move` block.

use proc_macro2::TokenStream;
use quote::quote_spanned;
use syn::spanned::Spanned;
use syn::{
    Expr, ExprAsync, GenericArgument, ItemFn, PathArguments, ReturnType, Stmt, Type,
    TypeParamBound, parse_quote,
};

/// A method in `#[async_trait]`'s shape: what it returns, and the async block.
pub struct AsyncTraitMethod {
    /// `R` of `Output = R`.
    ret: Type,
    /// The `async move { .. }` inside `Box::pin(..)`.
    inner: ExprAsync,
}

impl AsyncTraitMethod {
    /// Recognises a non-async `fn` returning `Pin<Box<dyn Future<Output = R> ..>>` whose
    /// body is `Box::pin(async move { .. })`, by any path.
    pub fn detect(func: &ItemFn) -> Option<AsyncTraitMethod> {
        if func.sig.asyncness.is_some() {
            return None;
        }
        let mut output = match &func.sig.output {
            ReturnType::Type(_, ty) => (**ty).clone(),
            ReturnType::Default => return None,
        };
        let ret = future_output(&mut output)?.clone();
        let [Stmt::Expr(Expr::Call(call), None)] = func.block.stmts.as_slice() else {
            return None;
        };
        let Expr::Path(callee) = &*call.func else { return None };
        let names: Vec<_> = callee.path.segments.iter().map(|s| s.ident.to_string()).collect();
        if !names.ends_with(&["Box".to_owned(), "pin".to_owned()]) || call.args.len() != 1 {
            return None;
        }
        let Expr::Async(inner) = &call.args[0] else { return None };
        inner.capture?;
        Some(AsyncTraitMethod { ret, inner: inner.clone() })
    }

    /// The method as written before `#[async_trait]`: `async fn .. -> R` with the inner
    /// block's statements, for the checks `#[idempotent]` makes on any handler.
    pub fn as_written(&self, func: &ItemFn) -> ItemFn {
        let mut written = func.clone();
        written.sig.asyncness = Some(syn::Token![async](func.sig.fn_token.span));
        written.sig.output = self.declared_output();
        written.block = Box::new(self.inner.block.clone());
        written
    }

    /// The return type as the user declared it: `-> R`, or none for `()`.
    pub fn declared_output(&self) -> ReturnType {
        match &self.ret {
            Type::Tuple(unit) if unit.elems.is_empty() => ReturnType::Default,
            ret => parse_quote!(-> #ret),
        }
    }

    /// The user's body: `#[async_trait]`'s async block, which already carries a
    /// never-taken `return` of type `R` for inference.
    pub fn body(&self) -> TokenStream {
        let inner = &self.inner;
        quote_spanned!(inner.span()=> #inner)
    }

    /// Gives `func` the new `Output` and boxes `body` (an async block's contents) the way
    /// `#[async_trait]` does.
    pub fn finish(func: &mut ItemFn, output: Type, body: TokenStream) {
        if let ReturnType::Type(_, ty) = &mut func.sig.output {
            if let Some(slot) = future_output(ty) {
                *slot = output;
            }
        }
        let span = func.block.span();
        *func.block = parse_quote!({
            ::std::boxed::Box::pin(async move #body)
        });
        func.block.brace_token = syn::token::Brace(span);
    }
}

/// `R` in `Pin<Box<dyn Future<Output = R> + ..>>`, by any path.
fn future_output(ty: &mut Type) -> Option<&mut Type> {
    let pin = last_generic(ty, "Pin")?;
    let boxed = last_generic(pin, "Box")?;
    let Type::TraitObject(object) = boxed else { return None };
    object.bounds.iter_mut().find_map(|bound| {
        let TypeParamBound::Trait(bound) = bound else { return None };
        let future = bound.path.segments.last_mut().filter(|s| s.ident == "Future")?;
        let PathArguments::AngleBracketed(args) = &mut future.arguments else { return None };
        args.args.iter_mut().find_map(|arg| match arg {
            GenericArgument::AssocType(assoc) if assoc.ident == "Output" => Some(&mut assoc.ty),
            _ => None,
        })
    })
}

/// The one type argument of a path type whose last segment is `name`.
fn last_generic<'a>(ty: &'a mut Type, name: &str) -> Option<&'a mut Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last_mut().filter(|s| s.ident == name)?;
    let PathArguments::AngleBracketed(args) = &mut last.arguments else { return None };
    if args.args.len() != 1 {
        return None;
    }
    match args.args.first_mut()? {
        GenericArgument::Type(inner) => Some(inner),
        _ => None,
    }
}
