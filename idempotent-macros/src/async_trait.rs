//! Methods that `#[async_trait]` has already rewritten.
//!
//! On an `#[async_trait]` impl, that attribute runs first and turns
//! `async fn handle(&self, msg: &M) -> R { body }` into
//! `fn handle<'life0, ..>(&'life0 self, ..) -> Pin<Box<dyn Future<Output = R> + Send + 'async_trait>>`
//! with the body `Box::pin(async move { .. body .. })`. Like `tracing`'s
//! `#[instrument]`, `#[idempotent]` recognises that shape, checks the method as the user
//! wrote it (`async fn .. -> R`), and wraps the inner `async move` block.
//!
//! That block starts by moving the receiver and each by-value argument into itself
//! (`let __self = self; let msg = msg;`). Passed whole as the handler's body, it would
//! take them from under a `store = self.store` that `run` borrows meanwhile. So the
//! bindings of what the store's expression names move up into the new outer block
//! (where the key and the store are then written with `__self` for `self`), and the
//! rest becomes a plain (not `move`) `async` block, which captures those the way the
//! body uses them, as for any other handler. The other arguments stay moved into the
//! body, which thus needs no more than `Send` of them.

use proc_macro2::{Ident, TokenStream, TokenTree};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    Expr, ExprAsync, GenericArgument, ItemFn, Pat, PathArguments, ReturnType, Stmt, Type,
    TypeParamBound, parse_quote,
};

/// A method in `#[async_trait]`'s shape: what it returns, and the async block.
pub struct AsyncTraitMethod {
    /// `R` of `Output = R`.
    ret: Type,
    /// The `async move { .. }` inside `Box::pin(..)`.
    inner: ExprAsync,
    /// The bindings moved up to the outer block ([`hoist`](Self::hoist)).
    bindings: Vec<Stmt>,
    /// Whether they include `__self`.
    binds_self: bool,
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
        Some(AsyncTraitMethod {
            ret,
            inner: inner.clone(),
            bindings: Vec::new(),
            binds_self: false,
        })
    }

    /// Moves up the bindings of the names `store` (the store's expression) uses: of
    /// `__self` if it reads `self`. The block then stops being `move`.
    pub fn hoist(&mut self, store: &TokenStream) {
        let mut names = Vec::new();
        idents(store.clone(), &mut names);
        let mut leading = true;
        let stmts = std::mem::take(&mut self.inner.block.stmts);
        for stmt in stmts {
            let Stmt::Local(local) = &stmt else {
                leading &= is_fake_return(&stmt);
                self.inner.block.stmts.push(stmt);
                continue;
            };
            let bound = local_ident(&local.pat).filter(|_| leading && is_binding(local));
            let used = bound.is_some_and(|ident| {
                let name = if ident == "__self" { "self".to_owned() } else { ident.to_string() };
                names.contains(&name)
            });
            if used {
                self.binds_self |= bound.is_some_and(|ident| ident == "__self");
                self.bindings.push(stmt);
            } else {
                leading &= is_binding(local);
                self.inner.block.stmts.push(stmt);
            }
        }
        if !self.bindings.is_empty() {
            self.inner.capture = None;
        }
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

    /// The user's body: `#[async_trait]`'s async block, less what [`hoist`](Self::hoist)
    /// moved up. It already carries a never-taken `return` of type `R` for inference.
    pub fn body(&self) -> TokenStream {
        let inner = &self.inner;
        quote_spanned!(inner.span()=> #inner)
    }

    /// The bindings, for the top of the outer block.
    pub fn bindings(&self) -> TokenStream {
        let bindings = &self.bindings;
        quote!(#(#bindings)*)
    }

    /// `tokens` (the key's and the store's expressions) with `__self` for `self`, once
    /// the receiver has moved there.
    pub fn rename_self(&self, tokens: TokenStream) -> TokenStream {
        if !self.binds_self {
            return tokens;
        }
        let tokens: Vec<TokenTree> = tokens.into_iter().collect();
        let mut renamed = Vec::with_capacity(tokens.len());
        for (i, token) in tokens.iter().enumerate() {
            let path_follows =
                matches!(tokens.get(i + 1), Some(TokenTree::Punct(p)) if p.as_char() == ':');
            renamed.push(match token {
                TokenTree::Ident(ident) if ident == "self" && !path_follows => {
                    TokenTree::Ident(Ident::new("__self", ident.span()))
                }
                TokenTree::Group(group) => {
                    let mut inner = proc_macro2::Group::new(
                        group.delimiter(),
                        self.rename_self(group.stream()),
                    );
                    inner.set_span(group.span());
                    TokenTree::Group(inner)
                }
                other => other.clone(),
            });
        }
        renamed.into_iter().collect()
    }

    /// `func` returning `output`, with `#[async_trait]`'s block type-checked but never
    /// run: what an attribute with a mistake expands to, beside its error.
    pub fn stand_in(&self, mut func: ItemFn, output: Type) -> TokenStream {
        let inner = &self.inner;
        Self::finish(&mut func, output, quote!({ let _ = #inner; ::core::unreachable!() }));
        quote!(#func)
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

/// `#[async_trait]`'s binding of an argument: `let [mut] __self = self;`,
/// `let [mut] msg = msg;`, or, for a pattern, `let (a, b) = { let __arg1 = __arg1; __arg1 };`.
fn is_binding(local: &syn::Local) -> bool {
    let Some(init) = &local.init else { return false };
    if init.diverge.is_some() {
        return false;
    }
    match &*init.expr {
        Expr::Path(path) => {
            let Some(from) = path.path.get_ident() else { return false };
            local_ident(&local.pat)
                .is_some_and(|to| (to == "__self" && from == "self") || to == from)
        }
        Expr::Block(block) => match block.block.stmts.as_slice() {
            [Stmt::Local(inner), Stmt::Expr(Expr::Path(path), None)] => {
                is_binding(inner)
                    && path.path.get_ident().is_some_and(|p| local_ident(&inner.pat) == Some(p))
            }
            _ => false,
        },
        _ => false,
    }
}

/// Every identifier in `tokens`, as text.
fn idents(tokens: TokenStream, into: &mut Vec<String>) {
    for token in tokens {
        match token {
            TokenTree::Ident(ident) => into.push(ident.to_string()),
            TokenTree::Group(group) => idents(group.stream(), into),
            _ => {}
        }
    }
}

/// `x` of the pattern `x` or `mut x`.
fn local_ident(pat: &Pat) -> Option<&Ident> {
    match pat {
        Pat::Ident(ident) if ident.by_ref.is_none() && ident.subpat.is_none() => Some(&ident.ident),
        _ => None,
    }
}

/// `#[async_trait]`'s never-taken `if let Some(__ret) = None::<R> { return __ret; }`,
/// which comes before the bindings.
fn is_fake_return(stmt: &Stmt) -> bool {
    matches!(stmt, Stmt::Expr(Expr::If(_), _))
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
