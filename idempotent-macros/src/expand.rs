//! Checks the attribute against the function and writes the idempotent version.

use proc_macro2::{Span, TokenStream};
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{
    FnArg, GenericArgument, Ident, ItemFn, LitStr, Pat, PathArguments, ReturnType, Type,
    parse_quote,
};

use crate::args::{Args, Errors};
use crate::async_trait::AsyncTraitMethod;
use crate::template::{self, Segment};

const DEFAULT_TTL_MS: u64 = 24 * 60 * 60 * 1000;
const DEFAULT_LEASE_MS: u64 = 30 * 1000;
const DEFAULT_MAX_ATTEMPTS: u32 = 5;
/// The shortest `lease` (`Spec::MIN_LEASE` in the runtime).
const MIN_LEASE_MS: u64 = 30;

/// Entry point. Never drops the user's function: on any error it is emitted as
/// written, next to the errors, so the rest of the crate still type-checks.
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let mut errors = Errors::default();
    let mut parsed = Args::default();
    let parser = syn::meta::parser(|meta| parsed.parse(meta, &mut errors));
    if let Err(e) = syn::parse::Parser::parse2(parser, args) {
        errors.push(e);
    }
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(_) => return with_errors(item.clone(), not_a_function(item)),
    };
    let async_trait = AsyncTraitMethod::detect(&func);
    let written = async_trait.as_ref().map(|method| method.as_written(&func));
    let krate: syn::Path =
        parsed.krate.get().cloned().unwrap_or_else(|| parse_quote!(::idempotent));
    match Handler::check(parsed, written.as_ref().unwrap_or(&func), async_trait.is_some(), errors) {
        Ok(handler) => handler.expand(func, async_trait),
        // The method with the signature the trait declares, so that the mistake is
        // not followed by a mismatch against the trait.
        Err(e) => match (&async_trait, &written) {
            (Some(method), Some(written)) => {
                let output = returns(&written.sig.output, &krate).output(&krate);
                with_errors(method.stand_in(func, parse_quote!(#output)), e)
            }
            _ => with_errors(item, e),
        },
    }
}

/// The error for an item that is not a function with a body, at its first keyword.
fn not_a_function(item: TokenStream) -> syn::Error {
    let general = "#[idempotent] goes on an `async fn` with a body: a free function, an `impl` \
                   method or a method in a trait impl";
    // A method declared in a trait, without a body (syn reads it as a verbatim item).
    if let Ok(declared) = syn::parse2::<syn::TraitItemFn>(item.clone()) {
        if declared.default.is_none() {
            return syn::Error::new(
                declared.sig.ident.span(),
                "#[idempotent] needs the method's body: put it on the method in each `impl` of \
                 the trait, and declare the trait's method returning \
                 `Result<idempotent::Outcome<T>, idempotent::Error<E>>`",
            );
        }
    }
    match syn::parse2::<syn::Item>(item) {
        Ok(syn::Item::Impl(imp)) => {
            let async_trait = imp
                .attrs
                .iter()
                .any(|a| a.path().segments.last().is_some_and(|s| s.ident == "async_trait"));
            let message = if async_trait {
                "#[idempotent] goes on each handler method inside the impl, not on the impl: \
                 write it on the `async fn`, below the impl's `#[async_trait]`"
            } else {
                "#[idempotent] goes on each handler method inside the impl, not on the impl: \
                 write it on the `async fn`"
            };
            syn::Error::new(imp.impl_token.span, message)
        }
        Ok(item) => syn::Error::new(first_keyword(&item), general),
        Err(_) => syn::Error::new(Span::call_site(), general),
    }
}

/// The span of an item's first token after its attributes and visibility.
fn first_keyword(item: &syn::Item) -> Span {
    let tokens = quote!(#item).into_iter().collect::<Vec<_>>();
    let mut i = 0;
    while i < tokens.len() {
        match &tokens[i] {
            proc_macro2::TokenTree::Punct(p) if p.as_char() == '#' => i += 2,
            proc_macro2::TokenTree::Ident(id) if id == "pub" => {
                i += 1;
                if let Some(proc_macro2::TokenTree::Group(g)) = tokens.get(i) {
                    if g.delimiter() == proc_macro2::Delimiter::Parenthesis {
                        i += 1;
                    }
                }
            }
            token => return token.span(),
        }
    }
    Span::call_site()
}

fn with_errors(item: TokenStream, error: syn::Error) -> TokenStream {
    let errors = error.to_compile_error();
    quote!(#item #errors)
}

/// What the handler's return type says about failure.
enum Returns {
    /// `Result<T, E>`, or a one-argument alias like `io::Result<T>`.
    Fallible { ok: TokenStream, err: TokenStream },
    /// Anything else: the handler cannot fail.
    Infallible { ok: TokenStream },
}

impl Returns {
    /// What the expanded handler returns: `Result<Outcome<T>, Error<E>>`.
    fn output(&self, krate: &syn::Path) -> TokenStream {
        let (ok, err) = match self {
            Returns::Fallible { ok, err } => (ok, err.clone()),
            Returns::Infallible { ok } => (ok, quote!(::core::convert::Infallible)),
        };
        quote!(::core::result::Result<#krate::Outcome<#ok>, #krate::Error<#err>>)
    }
}

/// Where a placeholder's value comes from.
struct Access {
    label: String,
    expr: TokenStream,
}

/// Everything the expansion needs, checked.
struct Handler {
    krate: syn::Path,
    namespace: String,
    ttl_ms: u64,
    lease_ms: u64,
    max_attempts: u32,
    /// `backoff`: base and cap in milliseconds.
    backoff: Option<(u64, u64)>,
    store: Option<syn::Expr>,
    classify: Option<syn::Path>,
    on_terminal: Option<syn::Path>,
    key: Vec<KeyPart>,
    /// The template, when every placeholder is a plain name: passed to `format_args!`
    /// so that rustc reports a field without `Display` at its placeholder.
    format_check: Option<LitStr>,
    /// The message, when `{/json/pointer}` placeholders read its payload.
    document: Option<TokenStream>,
    /// `validate = true`: the fingerprint expression's message, with the argument's span.
    validate: Option<(TokenStream, Span)>,
    /// `cache = true`, with the argument's span.
    cache: Option<Span>,
    /// `transactional`: where the transaction argument sits in the signature.
    transaction: Option<usize>,
    returns: Returns,
}

enum KeyPart {
    Text(String),
    Field(Access),
    Pointer(String),
}

impl Handler {
    fn check(
        mut args: Args,
        func: &ItemFn,
        async_trait: bool,
        mut errors: Errors,
    ) -> syn::Result<Handler> {
        let sig = &func.sig;
        let krate = args.krate.take().unwrap_or_else(|| parse_quote!(::idempotent));
        if sig.asyncness.is_none() {
            errors.at(
                sig.fn_token.span,
                "#[idempotent] needs an `async fn`: the claim and the store calls are awaited; \
                 write `async fn`",
            );
        }
        if let Some(variadic) = &sig.variadic {
            errors.at(variadic.span(), "#[idempotent] does not support variadic functions");
        }

        let transaction = transaction_argument(&args, sig, &mut errors);
        if let (Some(_), true) = (transaction, async_trait) {
            errors.at(
                args.transactional.span().unwrap_or_else(Span::call_site),
                "`transactional` can't be used in an `#[async_trait]` impl: it takes the \
                 transaction argument out of the signature, which must stay the trait's; make \
                 the transactional handler an inherent method or a free function and call it \
                 from the trait method",
            );
        }

        // Named arguments, in order; `self` and the transaction are never the message.
        let mut has_receiver = false;
        let mut named: Vec<(&Ident, &syn::PatType)> = Vec::new();
        for (i, input) in sig.inputs.iter().enumerate() {
            if Some(i) == transaction {
                continue;
            }
            match input {
                FnArg::Receiver(_) => has_receiver = true,
                FnArg::Typed(pt) => match &*pt.pat {
                    Pat::Ident(p) if p.subpat.is_none() => named.push((&p.ident, pt)),
                    _ => {}
                },
            }
        }

        // The message: named by `message = ...`, else the first argument after `self`.
        // A default that can't serve is only an error if the key needs the message.
        let errors_before = errors.count();
        let mut no_message: Option<syn::Error> = None;
        let message: Option<Ident> = match args.message.take() {
            Some(ident) if ident == "self" => {
                errors.at(
                    ident.span(),
                    "`self` can't be the message: name the argument that carries it, e.g. \
                     `message = order`; read receiver fields with `{self.field}` in the key",
                );
                None
            }
            Some(ident) => {
                if named.iter().any(|(n, _)| **n == ident) {
                    Some(ident)
                } else {
                    let names: Vec<String> = named.iter().map(|(n, _)| n.to_string()).collect();
                    errors.at(
                        ident.span(),
                        format_args!(
                            "`message = {ident}`: no argument is named `{ident}`; the arguments are: {}",
                            if names.is_empty() { "(none)".to_owned() } else { names.join(", ") }
                        ),
                    );
                    None
                }
            }
            // An argument under `#[cfg]` may not exist: it is never the default.
            None => match sig.inputs.iter().enumerate().find_map(|(i, input)| match input {
                FnArg::Typed(pt) if Some(i) != transaction && !is_cfg_gated(&pt.attrs) => Some(pt),
                _ => None,
            }) {
                Some(pt) => match &*pt.pat {
                    Pat::Ident(p) if p.subpat.is_none() => Some(p.ident.clone()),
                    pat => {
                        no_message = Some(syn::Error::new(
                            pat.span(),
                            "the key reads the message, so the message argument must be a plain \
                             name: bind it as `msg: Type` and destructure inside the body, or \
                             name another argument with `message = ...`",
                        ));
                        None
                    }
                },
                None => {
                    no_message = Some(syn::Error::new(
                        sig.ident.span(),
                        "#[idempotent] needs a message argument to build the key from: add one, \
                         e.g. `msg: OrderPlaced`",
                    ));
                    None
                }
            },
        };
        // Placeholders can't be resolved against a message argument that was rejected.
        let message_rejected = errors.count() > errors_before;

        // Key: a template or a function, not both.
        let mut key = Vec::new();
        let mut format_check = None;
        let mut document = None;
        let mut needs_message = false;
        match (args.key.take(), args.key_fn.take()) {
            (Some(_), Some(path)) => errors.at(
                path.span(),
                "give either `key` or `key_fn`, not both: `key_fn` replaces the template",
            ),
            (None, None) if !args.key_written => errors.at(
                Span::call_site(),
                "missing `key`: say what identifies a message, e.g. \
                 #[idempotent(key = \"order:{order_id}\")], or pass `key_fn = path`",
            ),
            (None, None) => {}
            (Some(lit), None) => match template::parse(&lit) {
                Ok(segments) => {
                    if segments.iter().all(plain_name) {
                        format_check = Some(lit.clone());
                    }
                    for segment in segments {
                        match segment {
                            Segment::Text(text) => key.push(KeyPart::Text(text)),
                            Segment::Pointer(pointer) => match &message {
                                Some(msg) => {
                                    let located = msg.span().located_at(lit.span());
                                    let mut msg = msg.clone();
                                    msg.set_span(located);
                                    document = Some(quote_spanned!(lit.span()=> &#msg));
                                    key.push(KeyPart::Pointer(pointer));
                                }
                                None => needs_message = true,
                            },
                            Segment::Placeholder(parts) => {
                                match resolve(&parts, &lit, has_receiver, &named, message.as_ref())
                                {
                                    Ok(Some(access)) => key.push(KeyPart::Field(access)),
                                    Ok(None) => needs_message = true,
                                    Err(e) => errors.push(e),
                                }
                            }
                        }
                    }
                }
                Err(e) => errors.push(e),
            },
            (None, Some(path)) => match &message {
                Some(msg) => {
                    // The message's type, when written, so that a function of another
                    // shape is reported against it (`fn(&Parcel)`), not against `_`.
                    let key_fn = respan(quote!(#krate::__private::KeyFn), path.span());
                    let ty = named.iter().find(|(n, _)| *n == msg).map(|(_, pt)| &*pt.ty);
                    let expr = match ty.map(ungroup_type) {
                        Some(Type::Reference(r)) if !mentions_impl_trait(&r.elem) => {
                            let elem = &r.elem;
                            quote_spanned!(path.span()=> #key_fn::<#elem>::key(#path, #msg))
                        }
                        Some(ty) if !mentions_impl_trait(ty) => {
                            quote_spanned!(path.span()=> #key_fn::<#ty>::key(#path, &#msg))
                        }
                        _ => quote_spanned!(path.span()=> #key_fn::key(#path, &#msg)),
                    };
                    let label = "key_fn".to_owned();
                    key.push(KeyPart::Field(Access { label, expr }));
                }
                None => needs_message = true,
            },
        }
        let validate = match (args.validate.get(), args.validate.span(), &message) {
            (Some(true), Some(span), Some(msg)) => {
                let mut msg = msg.clone();
                msg.set_span(msg.span().located_at(span));
                Some((quote_spanned!(span=> &#msg), span))
            }
            (Some(true), _, None) => {
                needs_message = true;
                None
            }
            _ => None,
        };
        let cache = args.cache.span().filter(|_| args.cache.get() == Some(&true));
        if needs_message && !message_rejected {
            if let Some(e) = no_message.take() {
                errors.push(e);
            }
        }

        let ttl_ms = args.ttl.get().map_or(DEFAULT_TTL_MS, |t| t.ms);
        if let Some(ttl) = args.ttl.get().filter(|t| t.ms < MIN_LEASE_MS) {
            errors.at(
                ttl.span,
                format_args!(
                    "`ttl` must be at least {MIN_LEASE_MS}ms: a claim's lease, at least \
                     {MIN_LEASE_MS}ms, can't outlive the dedupe window"
                ),
            );
        }
        let lease_ms = match args.lease.get() {
            Some(lease) => {
                if lease.ms < MIN_LEASE_MS {
                    errors.at(
                        lease.span,
                        format_args!(
                            "`lease` must be at least {MIN_LEASE_MS}ms: it is renewed every third \
                             of itself, and a shorter one could lapse between two renewals"
                        ),
                    );
                }
                if lease.ms > ttl_ms {
                    errors.at(
                        lease.span,
                        format_args!(
                            "`lease` ({}) must not exceed `ttl` ({}): a claim can't outlive the \
                             window in which its key is deduplicated",
                            human(lease.ms),
                            human(ttl_ms)
                        ),
                    );
                }
                lease.ms
            }
            None => DEFAULT_LEASE_MS.min(ttl_ms),
        };

        let namespace = match args.namespace.get() {
            Some(lit) => {
                let value = lit.value();
                if value.is_empty() || value.contains(':') {
                    errors.at(
                        lit.span(),
                        "`namespace` must be non-empty and must not contain `:` (it separates \
                         the namespace from the key)",
                    );
                }
                value
            }
            None => {
                let name = sig.ident.to_string().trim_start_matches("r#").to_owned();
                if has_receiver {
                    errors.at(
                        sig.ident.span(),
                        format_args!(
                            "#[idempotent] on a method needs `namespace = \"...\"`: the default, \
                             the method's name `{name}`, is shared by every `{name}` method on \
                             the same store, and their messages would be taken for each other's \
                             duplicates; name it, e.g. `namespace = \"billing.{name}\"`"
                        ),
                    );
                }
                name
            }
        };

        let returns = returns(&sig.output, &krate);
        if let (Returns::Infallible { .. }, Some(_)) = (&returns, transaction) {
            let at = match &sig.output {
                ReturnType::Type(_, ty) => ty.span(),
                ReturnType::Default => sig.paren_token.span.close(),
            };
            errors.at(
                at,
                "a `transactional` handler must return a `Result`: its queries can fail, and \
                 an `Err` is what rolls the transaction back",
            );
        }
        if let Returns::Infallible { .. } = returns {
            for (name, span) in
                [("classify", args.classify.span()), ("on_terminal", args.on_terminal.span())]
            {
                if let Some(span) = span {
                    errors.at(
                        span,
                        format_args!(
                            "`{name}` has no effect here: the handler can't fail, because its \
                             return type is not a `Result`"
                        ),
                    );
                }
            }
        }

        errors.finish()?;
        Ok(Handler {
            krate,
            namespace,
            ttl_ms,
            lease_ms,
            max_attempts: args.max_attempts.get().map_or(DEFAULT_MAX_ATTEMPTS, |(n, _)| *n),
            backoff: args.backoff.get().map(|b| (b.base_ms, b.cap_ms)),
            store: args.store.take(),
            classify: args.classify.take(),
            on_terminal: args.on_terminal.take(),
            key,
            format_check,
            document,
            validate,
            cache,
            transaction,
            returns,
        })
    }

    fn expand(self, mut func: ItemFn, mut async_trait: Option<AsyncTraitMethod>) -> TokenStream {
        let Handler { krate, namespace, ttl_ms, lease_ms, max_attempts, backoff, .. } = &self;
        let private = quote!(#krate::__private);
        let key_var = Ident::new("__idempotent_key", Span::mixed_site());
        let store_var = Ident::new("__idempotent_store", Span::mixed_site());

        let payload_var = Ident::new("__idempotent_payload", Span::mixed_site());
        let checked = self.format_check.is_some();
        let parts = self.key.iter().map(|part| match part {
            KeyPart::Text(text) => quote!(#key_var.text(#text);),
            KeyPart::Field(Access { label, expr }) if checked => {
                let shown = respan(quote!(#private::Shown), expr.span());
                quote_spanned!(expr.span()=> (&#shown(&#expr)).put(&mut #key_var, #label);)
            }
            KeyPart::Field(Access { label, expr }) => {
                // The whole call at the template, where rustc then reports a value
                // without `Display`.
                let key_var =
                    Ident::new("__idempotent_key", key_var.span().located_at(expr.span()));
                quote_spanned!(expr.span()=> #key_var.field(#label, &#expr);)
            }
            KeyPart::Pointer(pointer) => quote!(#key_var.pointer(#pointer, &#payload_var);),
        });
        // The payload is parsed once, for all pointers, and dropped with the block.
        let document = self.document.as_ref().map(|msg| {
            let private = respan(private.clone(), msg.span());
            let parse = quote_spanned!(msg.span()=> #private::Document::of(#msg));
            quote!(let #payload_var = #parse;)
        });
        let check = self.format_check.as_ref().map(|lit| {
            let mut names = Vec::new();
            let mut values = Vec::new();
            for part in &self.key {
                if let KeyPart::Field(Access { label, expr }) = part {
                    if !names.iter().any(|n: &Ident| n == label) {
                        names.push(Ident::new(label, lit.span()));
                        values.push(expr);
                    }
                }
            }
            quote! {
                #[allow(unused_imports)]
                use #private::{DisplayField as _, UncheckedField as _};
                if false {
                    let (#(#names,)*) = (#(&#values,)*);
                    #private::check_display(::core::format_args!(#lit));
                }
            }
        });
        // `(&Shown(&value)).put(..)`: the borrow picks the method, whatever clippy thinks.
        let allow = checked.then(|| quote!(#[allow(clippy::needless_borrow)]));
        let build_key = quote! {
            #allow
            let #key_var = {
                #check
                #document
                let mut #key_var = #private::KeyBuilder::new(#namespace);
                #(#parts)*
                #key_var.finish()
            };
        };
        let store = match &self.store {
            Some(expr) if self.transaction.is_some() => {
                // A store that is not transactional is reported once, at the
                // expression: `run_transactional` then gets a stand-in that is.
                let private = respan(private.clone(), expr.span());
                // Named at the expression (rustc blames the argument), and bound
                // once: the expression may make a temporary the borrow extends.
                let checked = Ident::new("__idempotent_checked_store", expr.span());
                quote_spanned! {expr.span()=>
                    let #store_var = &(#expr);
                    let #checked = #store_var;
                    #private::require_transactional(#checked);
                    let #store_var = {
                        #[allow(unused_imports)]
                        use #private::{CheckedTxStore as _, UncheckedTxStore as _};
                        #private::TxStore(#store_var).transactional_store()
                    };
                }
            }
            Some(expr) => {
                let as_store = quote_spanned!(expr.span()=> #store_var.__idempotent_as_store());
                quote! {
                    let #store_var = &(#expr);
                    let #store_var = {
                        use #private::AsStore as _;
                        #as_store
                    };
                }
            }
            None => quote!(let #store_var = &#private::DefaultStore;),
        };
        let spec = quote! {
            #private::Spec::new(
                ::core::time::Duration::from_millis(#ttl_ms),
                ::core::time::Duration::from_millis(#lease_ms),
                #max_attempts,
            )
        };
        let spec = match backoff {
            None => spec,
            Some((base, cap)) if base == cap => quote! {
                #spec.with_backoff(#private::Backoff::fixed(
                    ::core::time::Duration::from_millis(#base),
                ))
            },
            Some((base, cap)) => quote! {
                #spec.with_backoff(#private::Backoff::exponential(
                    ::core::time::Duration::from_millis(#base),
                    ::core::time::Duration::from_millis(#cap),
                ))
            },
        };

        let validated = self
            .validate
            .as_ref()
            .map(|(msg, span)| quote_spanned!(*span=> .validated(#private::Fingerprint::of(#msg))));
        let cached = self.cache.map(|span| quote_spanned!(span=> .cached()));
        let call_var = Ident::new("__idempotent_call", Span::mixed_site());
        let build_call = quote! {
            let #call_var = #private::Call::new(#spec, #key_var) #validated #cached;
        };

        // `transactional`: the transaction argument leaves the signature; the body
        // borrows the transaction `run_transactional` puts in the slot.
        let slot_var = Ident::new("__idempotent_tx", Span::mixed_site());
        let (slot, lend) = match self.transaction {
            Some(index) => {
                let inputs = std::mem::take(&mut func.sig.inputs);
                let mut lent = None;
                for (i, input) in inputs.into_iter().enumerate() {
                    match input {
                        FnArg::Typed(pt) if i == index => lent = Some(pt),
                        other => func.sig.inputs.push(other),
                    }
                }
                let syn::PatType { pat, ty, .. } = lent.expect("checked: the argument exists");
                // A type that is not sqlx's transaction on the store's database is
                // reported at the user's type, with the type to write.
                let lent_var = Ident::new("__idempotent_lent", Span::mixed_site());
                let lent_ty = match ungroup_type(&ty) {
                    Type::Reference(reference) => &*reference.elem,
                    other => other,
                };
                let borrow = quote_spanned! {lent_ty.span()=>
                    #lent_var.as_handler_tx::<#lent_ty>()
                };
                (
                    Some(quote!(let #slot_var = #private::TxSlot::for_store(#store_var);)),
                    quote! {
                        let mut #lent_var = #slot_var.lend();
                        let #pat: #ty = #borrow;
                    },
                )
            }
            None => (None, quote!()),
        };
        if let (Some(method), Some(store)) = (&mut async_trait, &self.store) {
            method.hoist(&quote!(#store));
        }
        let body = match &async_trait {
            Some(method) => method.body(),
            None => body_block(&func, lend),
        };
        let output = self.returns.output(krate);
        let call = match &self.returns {
            Returns::Fallible { err, .. } => {
                // `E: Classify` asked once, at the error type, by a function whose
                // answer (a `fn` pointer) `run`'s bounds then take without asking again;
                // a hook of the wrong shape is likewise one error, at its path.
                let classify = match &self.classify {
                    Some(path) => quote!(#path),
                    None => {
                        let classifier = respan(quote!(#private::classifier), err.span());
                        quote_spanned!(err.span()=> #classifier::<#err>())
                    }
                };
                let (require_hook, on_terminal) = match &self.on_terminal {
                    Some(path) => {
                        let private = respan(private.clone(), path.span());
                        (
                            quote_spanned!(path.span()=> #private::require_hook(&#path);),
                            quote_spanned!(path.span()=> {
                                #[allow(unused_imports)]
                                use #private::{CheckedHook as _, UncheckedHook as _};
                                #private::Hook(#path).hook()
                            }),
                        )
                    }
                    None => (quote!(), quote!(#private::process_sink)),
                };
                let call = match self.transaction {
                    Some(_) => quote! {
                        #private::run_transactional(
                            #call_var, #store_var, &#slot_var, #classify, #on_terminal, #body
                        ).await
                    },
                    None => quote! {
                        #private::run(#call_var, #store_var, #classify, #on_terminal, #body).await
                    },
                };
                quote!(#require_hook #call)
            }
            Returns::Infallible { ok } => {
                // A `Result` under another name would have its `Err` recorded as a
                // success: refuse it, at the return type.
                let declared = match &async_trait {
                    Some(method) => method.declared_output(),
                    None => func.sig.output.clone(),
                };
                let check = match &declared {
                    ReturnType::Type(_, ty) if !mentions_impl_trait(ty) => {
                        quote_spanned! {ty.span()=>
                            #private::require_value({
                                #[allow(unused_imports)]
                                use #private::{AnyValue as _, ResultValue as _};
                                (&#private::ValueType::<#ok>::new()).probe()
                            });
                        }
                    }
                    _ => quote!(),
                };
                quote!(#check #private::run_infallible(#call_var, #store_var, #body).await)
            }
        };

        // On an `#[async_trait]` method the receiver and by-value arguments are moved
        // to `#[async_trait]`'s bindings first, and read from there.
        let (bindings, build_key, build_call, store) = match &async_trait {
            Some(method) => (
                method.bindings(),
                method.rename_self(build_key),
                method.rename_self(build_call),
                method.rename_self(store),
            ),
            None => (quote!(), build_key, build_call, store),
        };
        let new_body = quote!({
            #bindings
            #build_key
            #build_call
            #store
            #slot
            #call
        });
        match async_trait {
            Some(_) => AsyncTraitMethod::finish(&mut func, parse_quote!(#output), new_body),
            None => {
                func.sig.output = parse_quote!(-> #output);
                *func.block = parse_quote!(#new_body);
            }
        }
        quote!(#func)
    }
}

/// The user's body as an `async` block. Not `move`: it captures each argument the
/// way the body uses it, so a `store = ...` expression may borrow an argument the body
/// also uses. A never-taken `return` typed as the
/// declared return type lets rustc infer `?` conversions and report type errors
/// against the user's own code.
fn body_block(func: &ItemFn, prelude: TokenStream) -> TokenStream {
    let stmts = &func.block.stmts;
    let fake_return = match &func.sig.output {
        ReturnType::Type(_, ty) if !mentions_impl_trait(ty) => {
            let fake = Ident::new("__idempotent_fake_return", Span::mixed_site());
            quote! {
                #[allow(
                    unknown_lints,
                    unreachable_code,
                    clippy::diverging_sub_expression,
                    clippy::let_unit_value,
                    clippy::unreachable,
                    clippy::empty_loop,
                    clippy::needless_return
                )]
                if false {
                    let #fake: #ty = loop {};
                    return #fake;
                }
            }
        }
        _ => quote!(),
    };
    quote_spanned!(func.block.span()=> async { #prelude #fake_return #(#stmts)* })
}

/// `transactional`: the position of the `&mut Transaction` argument the macro fills.
fn transaction_argument(args: &Args, sig: &syn::Signature, errors: &mut Errors) -> Option<usize> {
    let span = args.transactional.span().filter(|_| args.transactional.get() == Some(&true))?;
    if args.store.get().is_none() {
        errors.at(
            span,
            "`transactional` needs `store = ...` naming a `PostgresStore` or a `MysqlStore`: the \
             DONE record is written in its database, inside the handler's transaction",
        );
    }
    let found: Vec<usize> = (sig.inputs.iter().enumerate())
        .filter(|(_, input)| matches!(input, FnArg::Typed(pt) if is_transaction(&pt.ty)))
        .map(|(i, _)| i)
        .collect();
    match found.as_slice() {
        [] => {
            errors.at(
                span,
                "`transactional` lends the handler a transaction: add an argument \
                 `tx: &mut sqlx::Transaction<'_, sqlx::Postgres>` (`sqlx::MySql` on MySQL) and \
                 run the handler's writes on it",
            );
            None
        }
        [one] => Some(*one),
        [_, second, ..] => {
            errors.at(
                sig.inputs[*second].span(),
                "a `transactional` handler takes one transaction argument: its writes and the \
                 DONE record commit together in that one",
            );
            None
        }
    }
}

/// `ty` without the invisible groups a `macro_rules!` fragment (`$ret:ty`) wraps it in,
/// and without parentheses: `(Result<T, E>)` is a `Result`.
fn ungroup_type(ty: &Type) -> &Type {
    match ty {
        Type::Group(group) => ungroup_type(&group.elem),
        Type::Paren(paren) => ungroup_type(&paren.elem),
        other => other,
    }
}

/// `&mut Transaction<..>`, `&mut PgTransaction<..>` or `&mut MySqlTransaction<..>`, by
/// any path.
fn is_transaction(ty: &Type) -> bool {
    let Type::Reference(reference) = ungroup_type(ty) else { return false };
    let Type::Path(path) = ungroup_type(&reference.elem) else { return false };
    reference.mutability.is_some()
        && path.qself.is_none()
        && (path.path.segments.last()).is_some_and(|s| {
            ["Transaction", "PgTransaction", "MySqlTransaction"].iter().any(|t| s.ident == t)
        })
}

/// Whether an argument carries `#[cfg(..)]` (or `#[cfg_attr(..)]`).
fn is_cfg_gated(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| a.path().is_ident("cfg") || a.path().is_ident("cfg_attr"))
}

/// Whether `impl` appears anywhere in `ty`, also inside groups (`(impl Display, u64)`).
fn mentions_impl_trait(ty: &Type) -> bool {
    fn scan(tokens: TokenStream) -> bool {
        tokens.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => i == "impl",
            proc_macro2::TokenTree::Group(g) => scan(g.stream()),
            _ => false,
        })
    }
    scan(quote!(#ty))
}

fn returns(output: &ReturnType, krate: &syn::Path) -> Returns {
    let ty = match output {
        ReturnType::Default => return Returns::Infallible { ok: quote!(()) },
        ReturnType::Type(_, ty) => ungroup_type(ty),
    };
    if let Type::Path(path) = ty {
        if let Some(last) = path.path.segments.last() {
            if last.ident == "Result" {
                if let PathArguments::AngleBracketed(generics) = &last.arguments {
                    let types: Vec<&Type> = generics
                        .args
                        .iter()
                        .filter_map(|a| match a {
                            GenericArgument::Type(t) => Some(t),
                            _ => None,
                        })
                        .collect();
                    match types.as_slice() {
                        [ok, err] => {
                            return Returns::Fallible { ok: quote!(#ok), err: quote!(#err) };
                        }
                        [_] => {
                            let parts = quote!(<#ty as #krate::__private::HandlerResult>);
                            return Returns::Fallible {
                                ok: quote!(#parts::Ok),
                                err: quote!(#parts::Err),
                            };
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    Returns::Infallible { ok: quote!(#ty) }
}

/// Resolves `{a.b.c}`: `self` and argument names first, then a path on the message.
/// `Ok(None)`: the placeholder reads the message, and there is none.
fn resolve(
    parts: &[String],
    lit: &LitStr,
    has_receiver: bool,
    named: &[(&Ident, &syn::PatType)],
    message: Option<&Ident>,
) -> syn::Result<Option<Access>> {
    let span = lit.span();
    let label = parts.join(".");
    let members = |parts: &[String]| -> syn::Result<Vec<syn::Member>> {
        parts
            .iter()
            .map(|p| {
                let mut member: syn::Member = syn::parse_str(p).map_err(|_| {
                    syn::Error::new(
                        span,
                        format_args!("`{p}` in `{{{label}}}` is not a field name"),
                    )
                })?;
                // The template's own span: for a field that doesn't exist, rustc then
                // names the one with a similar name, or lists the fields there are. (Its
                // suggestion replaces the whole literal: stable Rust gives a macro no
                // span inside a string.)
                match &mut member {
                    syn::Member::Named(ident) => ident.set_span(span),
                    syn::Member::Unnamed(index) => index.span = span,
                }
                Ok(member)
            })
            .collect()
    };
    let first = &parts[0];
    let (base, rest): (TokenStream, &[String]) = if first == "self" {
        if !has_receiver {
            return Err(syn::Error::new(
                span,
                format_args!(
                    "`{{{label}}}` reads `self`, but this function has no `self` argument"
                ),
            ));
        }
        (quote_spanned!(span=> self), &parts[1..])
    } else if let Some((ident, _)) = named.iter().find(|(n, _)| *n == first) {
        let mut ident = (*ident).clone();
        ident.set_span(ident.span().located_at(span));
        (quote!(#ident), &parts[1..])
    } else if let Some(msg) = message {
        let mut msg = msg.clone();
        msg.set_span(msg.span().located_at(span));
        (quote!(#msg), parts)
    } else {
        return Ok(None);
    };
    let members = members(rest)?;
    let expr = quote!(#base #(.#members)*);
    Ok(Some(Access { label, expr }))
}

/// Whether `format_args!` reads the segment as the template does: text, or a
/// placeholder that is one name (not `self`, a tuple index or a JSON pointer).
fn plain_name(segment: &Segment) -> bool {
    match segment {
        Segment::Text(_) => true,
        Segment::Placeholder(parts) => match parts.as_slice() {
            [name] => name != "self" && syn::parse_str::<Ident>(name).is_ok(),
            _ => false,
        },
        Segment::Pointer(_) => false,
    }
}

/// `tokens` with every span set to `span`, so rustc reports errors in them there.
fn respan(tokens: TokenStream, span: Span) -> TokenStream {
    tokens
        .into_iter()
        .map(|mut token| {
            if let proc_macro2::TokenTree::Group(group) = &token {
                let mut inner =
                    proc_macro2::Group::new(group.delimiter(), respan(group.stream(), span));
                inner.set_span(span);
                token = proc_macro2::TokenTree::Group(inner);
            } else {
                token.set_span(span);
            }
            token
        })
        .collect()
}

/// `90000` → `"90s"`, for messages.
fn human(ms: u64) -> String {
    if ms % 1000 == 0 { format!("{}s", ms / 1000) } else { format!("{ms}ms") }
}
