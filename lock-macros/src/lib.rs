//! The `#[locked]` attribute of leasehold. Use it through the facade, as
//! `#[leasehold::locked(...)]`; this crate holds only the macro, and the code it generates calls
//! the runtime in `leasehold::__private`.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2, TokenTree};
use quote::{ToTokens, format_ident, quote, quote_spanned};
use syn::parse::{Parse, ParseStream};
use syn::spanned::Spanned;
use syn::{
    Attribute, Expr, ExprLit, FnArg, Ident, Lit, LitStr, Pat, Path, ReturnType, Signature, Type,
    Visibility,
};

mod duration;
mod ttl_bounds;

/// The arguments `#[locked]` accepts, for error messages.
const ACCEPTED: &str = "key, ttl, wait, renew, locker, crate";

#[doc = include_str!("../locked.md")]
#[proc_macro_attribute]
pub fn locked(args: TokenStream, item: TokenStream) -> TokenStream {
    let item = TokenStream2::from(item);
    match expand(args.into(), item.clone()) {
        Ok(out) => out.into(),
        Err(err) => {
            // The untouched item goes out beside the error, so the rest of the crate still
            // type-checks against it and IDEs keep working.
            let err = err.to_compile_error();
            quote!(#err #item).into()
        }
    }
}

/// `key = ...`: a format string capturing the parameters, or any expression.
enum Key {
    Format(LitStr),
    Expr(Expr),
}

/// `ttl = ...` / `wait = ...`: a human duration parsed here, or a `Duration` expression.
enum Dur {
    Parsed(std::time::Duration, Span),
    Expr(Expr),
}

#[derive(Default)]
struct Args {
    key: Option<Key>,
    ttl: Option<Dur>,
    wait: Option<Dur>,
    renew: Option<Expr>,
    locker: Option<Expr>,
    krate: Option<Path>,
}

fn parse_args(args: TokenStream2) -> syn::Result<Args> {
    let mut out = Args::default();
    let parser = syn::meta::parser(|meta| {
        let name = meta
            .path
            .get_ident()
            .map(ToString::to_string)
            .unwrap_or_else(|| meta.path.to_token_stream().to_string());
        let duplicate = || meta.error(format_args!("duplicate argument `{name}`"));
        match name.as_str() {
            "key" => {
                if out.key.is_some() {
                    return Err(duplicate());
                }
                out.key = Some(match ungroup(meta.value()?.parse::<Expr>()?) {
                    Expr::Lit(ExprLit {
                        lit: Lit::Str(s), ..
                    }) => {
                        check_key_literal(&s)?;
                        Key::Format(s)
                    }
                    e => Key::Expr(e),
                });
            }
            "ttl" | "wait" => {
                let slot = if name == "ttl" {
                    &mut out.ttl
                } else {
                    &mut out.wait
                };
                if slot.is_some() {
                    return Err(duplicate());
                }
                let d = match ungroup(meta.value()?.parse::<Expr>()?) {
                    Expr::Lit(ExprLit {
                        lit: Lit::Str(s), ..
                    }) => {
                        no_suffix(&s)?;
                        let d = duration::parse(&s.value())
                            .map_err(|why| syn::Error::new(s.span(), why))?;
                        // Only `ttl`: lock-core accepts any `wait`, up to `Duration::MAX`
                        // (wait as long as it takes).
                        if name == "ttl" {
                            check_ttl(d).map_err(|why| syn::Error::new(s.span(), why))?;
                        }
                        Dur::Parsed(d, s.span())
                    }
                    e => Dur::Expr(e),
                };
                *slot = Some(d);
            }
            "renew" => {
                if out.renew.is_some() {
                    return Err(duplicate());
                }
                // A bare `renew` reads as `renew = true`.
                out.renew = Some(if meta.input.peek(syn::Token![=]) {
                    meta.value()?.parse()?
                } else {
                    syn::parse_quote_spanned!(meta.path.span()=> true)
                });
            }
            "locker" => {
                if out.locker.is_some() {
                    return Err(duplicate());
                }
                out.locker = Some(meta.value()?.parse()?);
            }
            "crate" => {
                if out.krate.is_some() {
                    return Err(duplicate());
                }
                let value = meta.value()?;
                out.krate = Some(if value.peek(LitStr) {
                    let path = value.parse::<LitStr>()?;
                    no_suffix(&path)?;
                    path.parse()?
                } else {
                    Path::parse_mod_style(value)?
                });
            }
            _ => {
                return Err(meta.error(format_args!(
                    "unknown argument `{name}`; `#[locked]` accepts: {ACCEPTED}"
                )));
            }
        }
        Ok(())
    });
    syn::parse::Parser::parse2(parser, args)?;
    Ok(out)
}

/// Refuses a `ttl` literal that lock-core would refuse with `InvalidTtl` on every call.
/// Refuses a key literal that lock-core would refuse with `InvalidKey` on every call, whatever
/// its captures write: its fixed text (the literal less its `{...}` captures) is what every key
/// it makes contains.
fn check_key_literal(lit: &LitStr) -> syn::Result<()> {
    let (fixed, captures) = format_parts(&lit.value());
    let problem = if fixed.is_empty() && captures.is_empty() {
        "the key is empty"
    } else if fixed.contains(['{', '}']) {
        "the key contains `{` or `}` (written `{{` or `}}`), which would break its hash tag"
    } else if fixed.chars().any(char::is_control) {
        "the key contains a control character"
    } else if fixed.len() > ttl_bounds::MAX_KEY_LEN {
        "the key's fixed text is longer than MAX_KEY_LEN (512 bytes)"
    } else {
        return Ok(());
    };
    Err(syn::Error::new(
        lit.span(),
        format!("{problem}: lock-core would refuse it with `InvalidKey` on every call"),
    ))
}

/// An argument as written: a `macro_rules!` fragment (`$t:expr`) arrives wrapped in an
/// invisible group, and a literal passed through one must still be read as a literal; so must
/// one in parentheses (`key = ("order:{id}")` read as an expression would be the literal text
/// `order:{id}`, a key lock-core refuses on every call).
fn ungroup(e: Expr) -> Expr {
    match e {
        Expr::Group(g) => ungroup(*g.expr),
        Expr::Paren(p) => ungroup(*p.expr),
        e => e,
    }
}

fn check_ttl(ttl: std::time::Duration) -> Result<(), String> {
    use ttl_bounds::{MAX_TTL, MIN_TTL};
    let range = || {
        format!(
            "the allowed range is {} to {}",
            duration::format(MIN_TTL),
            duration::format(MAX_TTL)
        )
    };
    if ttl.is_zero() {
        Err("`ttl` must be greater than zero: a zero lease expires before it is granted".to_owned())
    } else if ttl < MIN_TTL {
        Err(format!("`ttl` is below MIN_TTL: {}", range()))
    } else if ttl > MAX_TTL {
        Err(format!(
            "`ttl` is above MAX_TTL: {}; for longer work keep a shorter lease renewed",
            range()
        ))
    } else {
        Ok(())
    }
}

/// Whether `ty` mentions `impl Trait`, which cannot be named in a `let` or a turbofish.
/// `ty` with every `impl Trait` in it left to inference (`_`): a `let` cannot name an opaque
/// type, but it can still pin the rest of the type (the error type `?` converts into, the
/// boxed trait object a value coerces to), as the signature does for a plain `async fn`.
fn impl_inferred(ty: &Type) -> Type {
    struct Infer;
    impl syn::visit_mut::VisitMut for Infer {
        fn visit_type_mut(&mut self, t: &mut Type) {
            if let Type::ImplTrait(i) = t {
                *t = Type::Infer(syn::TypeInfer {
                    underscore_token: syn::Token![_](i.impl_token.span),
                });
            } else {
                syn::visit_mut::visit_type_mut(self, t);
            }
        }
    }
    let mut ty = ty.clone();
    syn::visit_mut::VisitMut::visit_type_mut(&mut Infer, &mut ty);
    ty
}

/// `tokens` with every span set to `span`, so that errors in them point at the user's code;
/// but for `$crate`, which resolves by its span. A user's `macro_rules!` may pass
/// `crate = $crate::reexport`: in the span of a token its caller wrote, in another crate,
/// `$crate` would name that crate.
fn respan(tokens: TokenStream2, span: Span) -> TokenStream2 {
    tokens
        .into_iter()
        .map(|mut tt| {
            match &tt {
                TokenTree::Group(g) => {
                    let mut group =
                        proc_macro2::Group::new(g.delimiter(), respan(g.stream(), span));
                    group.set_span(span);
                    tt = TokenTree::Group(group);
                }
                TokenTree::Ident(i) if i == "$crate" => {}
                _ => tt.set_span(span),
            }
            tt
        })
        .collect()
}

/// A string literal the macro reads and does not emit: rustc never sees it, so a suffix on it
/// (`"30s"ms`) would pass unreported, where on any literal it compiles it is an error.
fn no_suffix(lit: &LitStr) -> syn::Result<()> {
    if lit.suffix().is_empty() {
        return Ok(());
    }
    Err(syn::Error::new(
        lit.span(),
        format_args!("a string literal here takes no suffix (`{}`)", lit.suffix()),
    ))
}

fn expand(args: TokenStream2, item: TokenStream2) -> syn::Result<TokenStream2> {
    let args = parse_args(args)?;
    let func: LockedFn = syn::parse2(item).map_err(|e| {
        syn::Error::new(
            e.span(),
            format_args!("`#[locked]` applies to an `async fn` with a body: {e}"),
        )
    })?;
    let sig = &func.sig;
    let taken = taken_params(sig, &args, &func.body);
    if sig.asyncness.is_none() {
        return Err(syn::Error::new(
            sig.fn_token.span,
            "`#[locked]` needs an `async fn`: the lease is held across the body's `.await`s",
        ));
    }
    let ret_ty = match &sig.output {
        ReturnType::Type(_, ty) => ty.as_ref().clone(),
        ReturnType::Default => {
            return Err(syn::Error::new(
                sig.ident.span(),
                "a `#[locked]` function must return `Result<T, E>` with `E: From<leasehold::Error>`: \
                 busy, wait-timeout and lease-lost are returned as errors, and this one returns `()`",
            ));
        }
    };
    // Parentheses (and the invisible groups of a type passed through `macro_rules!`) hide
    // nothing: `-> (impl Trait)` is the same type.
    let mut bare = &ret_ty;
    while let Type::Paren(syn::TypeParen { elem, .. }) | Type::Group(syn::TypeGroup { elem, .. }) =
        bare
    {
        bare = elem;
    }
    if let Type::ImplTrait(_) = bare {
        return Err(syn::Error::new(
            bare.span(),
            "a `#[locked]` function must return `Result<T, E>` with `E: From<leasehold::Error>`, not `impl Trait`",
        ));
    }
    let Some(key) = args.key else {
        return Err(syn::Error::new(
            Span::call_site(),
            "`#[locked]` needs `key = ...`: a format string such as `key = \"order:{order_id}\"` or an expression",
        ));
    };

    let krate = args.krate.unwrap_or_else(|| syn::parse_quote!(::leasehold));
    let private = quote!(#krate::__private);
    let site = Span::mixed_site();
    let (locker_var, key_var, settings_var) = (
        format_ident!("__lh_locker", span = site),
        format_ident!("__lh_key", span = site),
        format_ident!("__lh_settings", span = site),
    );

    let locker = match &args.locker {
        Some(e) => {
            let to_locker = respan(quote!(#private::LockerSource::to_locker), e.span());
            quote_spanned! {e.span()=>
                ::core::result::Result::Ok::<_, #private::Error>(#to_locker(&(#e)))
            }
        }
        None => quote!(#private::default_locker()),
    };
    let key = match &key {
        // Without captures (its text, escapes read, holds no brace) the literal is the key as
        // written: nothing to format, so no `format!` spanned at the user's code for a lint on
        // `format!` to take for theirs.
        Key::Format(lit) if !lit.value().contains(['{', '}']) => {
            quote!(::std::string::String::from(#lit))
        }
        // The literal keeps the user's span, so `{name}` resolves to the parameters and rustc
        // reports an unknown name where it is written.
        Key::Format(lit) => quote_spanned!(lit.span()=> ::std::format!(#lit)),
        Key::Expr(e) => quote_spanned!(e.span()=> ::std::string::ToString::to_string(&(#e))),
    };
    let duration = |d: &Option<Dur>| match d {
        None => quote!(::core::option::Option::None),
        Some(Dur::Parsed(d, span)) => {
            let ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
            quote_spanned! {*span=>
                ::core::option::Option::Some(::core::time::Duration::from_millis(#ms))
            }
        }
        Some(Dur::Expr(e)) => quote_spanned! {e.span()=>
            ::core::option::Option::Some::<::core::time::Duration>(#e)
        },
    };
    let (ttl, wait) = (duration(&args.ttl), duration(&args.wait));
    let renew = match &args.renew {
        Some(e) => quote_spanned!(e.span()=> ::core::option::Option::Some::<bool>(#e)),
        None => quote!(::core::option::Option::None),
    };
    // `r#match` names the function `match` (as `stringify!` would not say).
    let name = syn::ext::IdentExt::unraw(&sig.ident).to_string();

    // Names the return type inside the body so that `?` and `return` infer against it before
    // the body is checked, as tracing's `#[instrument]` does, but with a call that returns it
    // rather than unreachable code: that needs `#[allow]`s, which a crate that `forbid`s those
    // lints refuses. An `impl Trait` in it is left to inference, the rest still pinned.
    let pinned = impl_inferred(&ret_ty);
    let pin_type = quote_spanned! {ret_ty.span()=>
        if false {
            return #private::never::<#pinned>();
        }
    };
    // Spanned at the return type, so a type that cannot carry the lock's errors is reported
    // where it is written, once.
    let from_lock_error = respan(
        quote!(#private::LockedOutput::from_lock_error),
        ret_ty.span(),
    );
    let stmts = &func.body;
    let inner_attrs = &func.inner_attrs;
    // An `async move` block takes only the names its body mentions; the other parameters would
    // stay with the function's own future and be dropped after the release, outside the lease
    // (a guard `_tx` committing on drop would commit unprotected). Naming them moves them in,
    // to be dropped with the body, under the lease, as a plain `async fn` drops its parameters
    // when its body ends. Which ones: `taken_params`.
    let take_params = quote!(#(let _ = &#taken;)*);
    let mut run_body = proc_macro2::Group::new(
        proc_macro2::Delimiter::Brace,
        quote!(#take_params #pin_type #stmts),
    );
    run_body.set_span(func.body_span);
    let body = quote! {
        {
            #(#inner_attrs)*
            // Each argument in a statement of its own, before the body: a temporary of its
            // expression (a `RefCell` borrow, a mutex guard) then ends before the body runs,
            // not with the call that runs it.
            let #locker_var = #locker;
            let #key_var: ::std::string::String = #key;
            let #settings_var = #private::Settings {
                function: #name,
                ttl: #ttl,
                wait: #wait,
                renew: #renew,
            };
            #private::locked(
                #locker_var,
                #key_var,
                #settings_var,
                #from_lock_error,
                async move #run_body,
            )
            .await
        }
    };
    let LockedFn {
        outer_attrs,
        vis,
        sig,
        ..
    } = &func;
    Ok(quote!(#(#outer_attrs)* #vis #sig #body))
}

/// The parameters the body is made to own: owned names (see [`owned_params`]) that the body
/// mentions, that start with `_` or that the key's format string captures (`format!` only
/// borrows them), and `self` taken by value. One the body mentions is named too: an `async
/// move` block takes only the places its body uses, so a body that reads `job.id` alone
/// would take that field and leave the rest of `job` to be dropped after the release. Left
/// out, to be dropped after the release as before:
/// - a name an argument expression mentions (`key = into_key(order)`): the expression may
///   move it, before the body runs, and a later borrow would not compile;
/// - a parameter with an attribute (`#[cfg(...)]`): it may not exist;
/// - a name used nowhere, without a leading `_`: named in the body, it would no longer be
///   unused, and rustc's warning (or the user's `#[expect(unused_variables)]`) would go.
fn taken_params(sig: &Signature, args: &Args, body: &TokenStream2) -> Vec<Ident> {
    let mut in_body = Vec::new();
    idents_in(body.clone(), &mut in_body);
    let mut in_exprs = Vec::new();
    let exprs = [
        match &args.key {
            Some(Key::Expr(e)) => Some(e.to_token_stream()),
            _ => None,
        },
        args.locker.as_ref().map(ToTokens::to_token_stream),
        args.renew.as_ref().map(ToTokens::to_token_stream),
        match &args.ttl {
            Some(Dur::Expr(e)) => Some(e.to_token_stream()),
            _ => None,
        },
        match &args.wait {
            Some(Dur::Expr(e)) => Some(e.to_token_stream()),
            _ => None,
        },
    ];
    for tokens in exprs.into_iter().flatten() {
        idents_in(tokens, &mut in_exprs);
    }
    let captured = match &args.key {
        Some(Key::Format(lit)) => format_captures(&lit.value()),
        _ => Vec::new(),
    };
    owned_params(sig)
        .into_iter()
        .filter(|name| {
            let text = name.to_string();
            let bare = text.strip_prefix("r#").unwrap_or(&text);
            !in_exprs.contains(&text)
                && (text == "self"
                    || bare.starts_with('_')
                    || captured.iter().any(|c| c == bare)
                    || in_body.contains(&text))
        })
        .collect()
}

/// Every identifier in `tokens`, groups included, as text.
fn idents_in(tokens: TokenStream2, out: &mut Vec<String>) {
    for tree in tokens {
        match tree {
            TokenTree::Ident(i) => out.push(i.to_string()),
            TokenTree::Group(g) => idents_in(g.stream(), out),
            _ => {}
        }
    }
}

/// A format string's fixed text (`{{` and `}}` read as one brace) and what each of its
/// captures holds before any `:spec`, trimmed (`{name}` gives `name`, `{}` gives ``). A lone
/// `}` is left out, for `format!` to report.
fn format_parts(text: &str) -> (String, Vec<String>) {
    let mut fixed = String::new();
    let mut captures = Vec::new();
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '{' if chars.peek() == Some(&'{') => {
                chars.next();
                fixed.push('{');
            }
            '{' => {
                let inside: String = chars.by_ref().take_while(|&c| c != '}').collect();
                captures.push(inside.split(':').next().unwrap_or("").trim().to_owned());
            }
            '}' if chars.peek() == Some(&'}') => {
                chars.next();
                fixed.push('}');
            }
            '}' => {}
            c => fixed.push(c),
        }
    }
    (fixed, captures)
}

/// The names a format string captures: `{name}` and `{name:spec}`, not `{{` nor positions.
fn format_captures(text: &str) -> Vec<String> {
    format_parts(text)
        .1
        .into_iter()
        .map(|c| c.strip_prefix("r#").map(str::to_owned).unwrap_or(c))
        .filter(|c| c.starts_with(|c: char| c == '_' || c.is_alphabetic()))
        .collect()
}

/// The names of the parameters the function owns: those bound by value (not `ref`), in any
/// pattern, and `self` taken by value; not those of a parameter with an attribute (it may be
/// `#[cfg]`'d away). A `_` owns its value unnamed, so it is not among them.
fn owned_params(sig: &Signature) -> Vec<Ident> {
    fn bound(pat: &Pat, out: &mut Vec<Ident>) {
        match pat {
            Pat::Ident(p) => {
                if p.by_ref.is_none() {
                    out.push(p.ident.clone());
                }
                if let Some((_, sub)) = &p.subpat {
                    bound(sub, out);
                }
            }
            Pat::Tuple(t) => t.elems.iter().for_each(|p| bound(p, out)),
            Pat::TupleStruct(t) => t.elems.iter().for_each(|p| bound(p, out)),
            Pat::Struct(s) => s.fields.iter().for_each(|f| bound(&f.pat, out)),
            Pat::Slice(s) => s.elems.iter().for_each(|p| bound(p, out)),
            Pat::Reference(r) => bound(&r.pat, out),
            Pat::Paren(p) => bound(&p.pat, out),
            Pat::Type(t) => bound(&t.pat, out),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) if r.reference.is_none() && r.attrs.is_empty() => {
                out.push(Ident::from(r.self_token));
            }
            FnArg::Receiver(_) => {}
            FnArg::Typed(t) if t.attrs.is_empty() => bound(&t.pat, &mut out),
            FnArg::Typed(_) => {}
        }
    }
    out
}

/// The function as written, its body kept as tokens (as tokio's and tracing's attributes
/// keep it): the body is moved, never read, so one rustc accepts is never refused here,
/// whether it uses syntax newer than this syn or is half typed in an editor, where rustc then
/// reports the error once, itself.
struct LockedFn {
    outer_attrs: Vec<Attribute>,
    vis: Visibility,
    sig: Signature,
    inner_attrs: Vec<Attribute>,
    body: TokenStream2,
    /// The body's braces, given to the block that runs it: a body of the wrong type (a
    /// trailing `;`) is then reported at the body, not at the attribute.
    body_span: Span,
}

impl Parse for LockedFn {
    fn parse(input: ParseStream<'_>) -> syn::Result<Self> {
        let outer_attrs = input.call(Attribute::parse_outer)?;
        let vis = input.parse()?;
        let sig = input.parse()?;
        let content;
        let brace = syn::braced!(content in input);
        let inner_attrs = content.call(Attribute::parse_inner)?;
        let body = content.parse()?;
        Ok(LockedFn {
            outer_attrs,
            vis,
            sig,
            inner_attrs,
            body,
            body_span: brace.span.join(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The expansion for `args` on a function with one parameter, `id`, without whitespace.
    fn expanded(args: TokenStream2) -> String {
        let item = quote!(
            async fn f(id: u64) -> Result<(), E> {
                Ok(())
            }
        );
        let out = expand(args, item).expect("expands").to_string();
        out.split_whitespace().collect()
    }

    /// A key literal without captures is the key as written; one with captures is formatted.
    #[test]
    fn only_a_key_with_captures_is_formatted() {
        for (lit, want) in [
            (quote!("plain:key"), r#"String::from("plain:key")"#),
            (quote!(r"raw\key"), r#"String::from(r"raw\key")"#),
            // Escapes are read first: `\u{41}` is `A`, not a capture.
            (quote!("esc\u{41}"), r#"String::from("esc\u{41}")"#),
        ] {
            let out = expanded(quote!(key = #lit));
            assert!(out.contains(want), "{out}");
            assert!(!out.contains("format"), "{out}");
        }
        let out = expanded(quote!(key = "order:{id}"));
        assert!(out.contains(r#"::std::format!("order:{id}")"#), "{out}");
    }

    /// A bare `renew` asks for renewal as `renew = true` does; left out, the locker's default
    /// decides. (At run time renewal is on by default, so only the expansion tells them apart.)
    #[test]
    fn a_bare_renew_means_true() {
        let want = "renew:::core::option::Option::Some::<bool>(true)";
        assert!(expanded(quote!(key = "k", renew)).contains(want));
        assert!(expanded(quote!(key = "k", renew = true)).contains(want));
        let out = expanded(quote!(key = "k"));
        assert!(out.contains("renew:::core::option::Option::None"), "{out}");
    }

    /// Which parameters the body is made to own: owned names (by name, in a pattern, under
    /// `mut`; not `ref`, not a reference `self`, not one under an attribute) that start with
    /// `_`, that the key's format string captures or that the body mentions, and `self` by
    /// value; never one an argument expression mentions, nor one used nowhere (rustc's unused
    /// warning stays).
    #[test]
    fn the_body_is_made_to_own_the_right_parameters() {
        let taken = |args: TokenStream2, sig: Signature| -> Vec<String> {
            let args = parse_args(args).expect("args");
            taken_params(&sig, &args, &quote!({ Ok(()) }))
                .iter()
                .map(ToString::to_string)
                .collect()
        };
        let sig: Signature = syn::parse_quote!(
            async fn f(mut _a: A, (_b, ref _c): (B, C), S { _d, .. }: S, _: E, _x @ _y: u8,
                #[cfg(any())] _gone: G, id: u64, unused: U, r#type: T)
        );
        assert_eq!(
            taken(quote!(key = "k:{id}:{type:?}:{0}"), sig.clone()),
            ["_a", "_b", "_d", "_x", "_y", "id", "r#type"]
        );
        // Mentioned by an argument expression, which may move it: left where it is.
        assert_eq!(
            taken(quote!(key = into_key(_a, id), ttl = ttl_of(&_b)), sig),
            ["_d", "_x", "_y"]
        );
        let by_value: Signature = syn::parse_quote!(async fn m(self, z: Z));
        assert_eq!(taken(quote!(key = "k"), by_value), ["self"]);
        let by_ref: Signature = syn::parse_quote!(async fn m(&self, _z: Z));
        assert_eq!(taken(quote!(key = "k"), by_ref), ["_z"]);
        // Mentioned in the body, even through a field only (inside a group too): taken whole;
        // not when an argument expression mentions it as well.
        let args = parse_args(quote!(key = key_of(&other))).expect("args");
        let sig: Signature =
            syn::parse_quote!(async fn f(job: Job, other: Other, unused: U, r#ref: R));
        let body = quote!({
            work(job.id).await;
            if r#ref.ok {
                other.go()
            }
            Ok(())
        });
        let names: Vec<String> = taken_params(&sig, &args, &body)
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(names, ["job", "r#ref"]);
        assert_eq!(
            format_captures("{{a}}:{b}:{ c :>4}:{}:{1}:{r#d}"),
            ["b", "c", "d"]
        );
    }
}
