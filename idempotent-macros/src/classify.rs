//! `#[derive(Classify)]`: maps `#[idempotent(retryable | terminal | duplicate | transparent)]`
//! marks on an enum's variants (or a struct) to `Classify::class`.

use proc_macro2::{Span, TokenStream};
use quote::quote;
use syn::spanned::Spanned;
use syn::{Attribute, Data, DeriveInput, Fields, Path, parse_quote};

use crate::args::{Errors, did_you_mean};

#[derive(Clone)]
enum Mark {
    Retryable,
    Terminal,
    /// The effect was already applied.
    Duplicate,
    /// Delegates to the single field's own `Classify`.
    Transparent,
}

struct Marks {
    mark: Option<(Span, Mark)>,
    krate: Option<Path>,
}

pub fn derive(item: TokenStream) -> TokenStream {
    let input: DeriveInput = match syn::parse2(item) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    match expand(&input) {
        Ok(tokens) => tokens,
        Err(e) => {
            // An impl that type-checks, so each use of the type does not add its own
            // "does not implement Classify" to the real errors.
            let errors = e.to_compile_error();
            let fallback =
                implement(&input, &default_crate(&input), quote!(::core::unreachable!()), &[]);
            quote!(#errors #fallback)
        }
    }
}

fn default_crate(input: &DeriveInput) -> Path {
    marks(&input.attrs, true, &mut Errors::default())
        .krate
        .unwrap_or_else(|| parse_quote!(::idempotent))
}

/// The impl, with `bounds: Classify` added to the where clause: the types of the
/// `transparent` fields, which may be generic (`Wrapped<E>(E)` needs `E: Classify`).
fn implement(
    input: &DeriveInput,
    krate: &Path,
    body: TokenStream,
    bounds: &[syn::Type],
) -> TokenStream {
    let name = &input.ident;
    let mut generics = input.generics.clone();
    if !bounds.is_empty() {
        let clause = generics.make_where_clause();
        for ty in bounds {
            clause.predicates.push(parse_quote!(#ty: #krate::Classify));
        }
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        #[automatically_derived]
        impl #impl_generics #krate::Classify for #name #ty_generics #where_clause {
            fn class(&self) -> #krate::ErrorClass {
                #body
            }
        }
    }
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream> {
    let mut errors = Errors::default();
    let top = marks(&input.attrs, true, &mut errors);
    let top_misread = errors.count() > 0;
    let krate = top.krate.clone().unwrap_or_else(|| parse_quote!(::idempotent));
    let mut bounds: Vec<syn::Type> = Vec::new();
    let mut class = |mark: &Mark, fields: &Fields, span: Span, errors: &mut Errors| match mark {
        Mark::Retryable => quote!(#krate::ErrorClass::Retryable),
        Mark::Terminal => quote!(#krate::ErrorClass::Terminal),
        Mark::Duplicate => quote!(#krate::ErrorClass::Duplicate),
        Mark::Transparent => {
            if fields.len() != 1 {
                errors.at(
                    span,
                    "`transparent` delegates to the one field's own `Classify`: use it on a \
                     variant or struct with exactly one field",
                );
            }
            if let Some(field) = fields.iter().next().filter(|f| is_generic(&f.ty, input)) {
                bounds.push(field.ty.clone());
            }
            quote!(#krate::Classify::class(__idempotent_inner))
        }
    };
    let pattern = |path: TokenStream, fields: &Fields, mark: &Mark| match (fields, mark) {
        (Fields::Named(f), Mark::Transparent) => {
            let name = f.named.first().and_then(|f| f.ident.clone());
            quote!(#path { #name: __idempotent_inner, .. })
        }
        (Fields::Unnamed(_), Mark::Transparent) => quote!(#path(__idempotent_inner, ..)),
        (Fields::Named(_), _) => quote!(#path { .. }),
        (Fields::Unnamed(_), _) => quote!(#path(..)),
        (Fields::Unit, _) => quote!(#path),
    };

    let body = match &input.data {
        Data::Enum(data) => {
            let arms: Vec<TokenStream> = data
                .variants
                .iter()
                .filter_map(|variant| {
                    let before = errors.count();
                    let own = marks(&variant.attrs, false, &mut errors);
                    let mark = own.mark.or_else(|| top.mark.clone());
                    // A mark reported as wrong is the one mistake: no "no class" too.
                    let misread = top_misread || errors.count() > before;
                    let Some((span, mark)) = mark else {
                        if misread {
                            return None;
                        }
                        errors.at(
                            variant.ident.span(),
                            format_args!(
                                "variant `{}` has no class: mark it #[idempotent(retryable)] or \
                                 #[idempotent(terminal)], or give the enum a default with one of \
                                 those on the enum itself",
                                variant.ident
                            ),
                        );
                        return None;
                    };
                    let ident = &variant.ident;
                    let pat = pattern(quote!(Self::#ident), &variant.fields, &mark);
                    let class = class(&mark, &variant.fields, span, &mut errors);
                    Some(quote!(#pat => #class,))
                })
                .collect();
            if data.variants.is_empty() {
                // No value of an empty enum exists to classify.
                quote!(match *self {})
            } else {
                quote!(match self { #(#arms)* })
            }
        }
        Data::Struct(data) => match &top.mark {
            Some((span, mark)) => {
                let pat = pattern(quote!(Self), &data.fields, mark);
                let class = class(mark, &data.fields, *span, &mut errors);
                quote!(let #pat = self; #class)
            }
            None if top_misread => quote!(::core::unreachable!()),
            None => {
                errors.at(
                    input.ident.span(),
                    "mark the struct #[idempotent(retryable)], #[idempotent(terminal)], \
                     #[idempotent(duplicate)] or #[idempotent(transparent)] to say how its \
                     errors are classified",
                );
                quote!(::core::unreachable!())
            }
        },
        Data::Union(u) => {
            errors.at(u.union_token.span(), "#[derive(Classify)] supports enums and structs");
            quote!(::core::unreachable!())
        }
    };
    errors.finish()?;
    Ok(implement(input, &krate, body, &bounds))
}

/// Reads `#[idempotent(...)]` marks. `crate = path` is accepted on the type only.
fn marks(attrs: &[Attribute], top: bool, errors: &mut Errors) -> Marks {
    let mut marks = Marks { mark: None, krate: None };
    for attr in attrs.iter().filter(|a| a.path().is_ident("idempotent")) {
        let result = attr.parse_nested_meta(|meta| {
            let span = meta.path.span();
            let mark = if meta.path.is_ident("retryable") {
                Mark::Retryable
            } else if meta.path.is_ident("terminal") {
                Mark::Terminal
            } else if meta.path.is_ident("duplicate") {
                Mark::Duplicate
            } else if meta.path.is_ident("transparent") {
                Mark::Transparent
            } else if top && meta.path.is_ident("crate") {
                let lit: syn::LitStr = meta.value()?.parse()?;
                marks.krate = Some(lit.parse()?);
                return Ok(());
            } else {
                let word = meta.path.get_ident().map(ToString::to_string).unwrap_or_default();
                let known = ["retryable", "terminal", "duplicate", "transparent"];
                errors.at(
                    span,
                    format_args!(
                        "unknown mark `{word}`{}: expected #[idempotent(retryable)], \
                         #[idempotent(terminal)], #[idempotent(duplicate)] or \
                         #[idempotent(transparent)]",
                        did_you_mean(&word, known)
                    ),
                );
                return Ok(());
            };
            if marks.mark.is_some() {
                errors.at(span, "give one class: retryable, terminal, duplicate or transparent");
            } else {
                marks.mark = Some((span, mark));
            }
            Ok(())
        });
        if let Err(e) = result {
            errors.push(e);
        }
    }
    marks
}

/// Whether `ty` mentions one of the input's type parameters (only such field types
/// need a `Classify` bound; a bound on a concrete private type would warn).
fn is_generic(ty: &syn::Type, input: &DeriveInput) -> bool {
    fn mentions(tokens: TokenStream, names: &[&syn::Ident]) -> bool {
        tokens.into_iter().any(|t| match t {
            proc_macro2::TokenTree::Ident(i) => names.contains(&&i),
            proc_macro2::TokenTree::Group(g) => mentions(g.stream(), names),
            _ => false,
        })
    }
    let names: Vec<&syn::Ident> = input.generics.type_params().map(|p| &p.ident).collect();
    !names.is_empty() && mentions(quote!(#ty), &names)
}
