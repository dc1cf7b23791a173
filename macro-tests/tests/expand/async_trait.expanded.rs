use std::sync::Arc;
use idempotent::{Error, MemoryStore, Outcome, async_trait, idempotent};
struct Order {
    id: String,
}
trait Handler {
    #[allow(
        elided_named_lifetimes,
        clippy::type_complexity,
        clippy::type_repetition_in_bounds
    )]
    fn handle<'life0, 'life1, 'async_trait>(
        &'life0 self,
        order: &'life1 Order,
    ) -> ::core::pin::Pin<
        Box<
            dyn ::core::future::Future<
                Output = Result<Outcome<()>, Error<std::convert::Infallible>>,
            > + ::core::marker::Send + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait;
}
struct Consumer {
    store: Arc<MemoryStore>,
    tenant: String,
}
impl Handler for Consumer {
    #[allow(
        elided_named_lifetimes,
        clippy::async_yields_async,
        clippy::diverging_sub_expression,
        clippy::let_unit_value,
        clippy::needless_arbitrary_self_type,
        clippy::no_effect_underscore_binding,
        clippy::shadow_same,
        clippy::type_complexity,
        clippy::type_repetition_in_bounds,
        clippy::used_underscore_binding
    )]
    fn handle<'life0, 'life1, 'async_trait>(
        &'life0 self,
        order: &'life1 Order,
    ) -> ::core::pin::Pin<
        Box<
            dyn ::core::future::Future<
                Output = ::core::result::Result<
                    ::idempotent::Outcome<()>,
                    ::idempotent::Error<::core::convert::Infallible>,
                >,
            > + ::core::marker::Send + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        Self: 'async_trait,
    {
        ::std::boxed::Box::pin(async move {
            let __self = self;
            let __idempotent_key = {
                let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new(
                    "billing.charge",
                );
                __idempotent_key.field("self.tenant", &__self.tenant);
                __idempotent_key.text("/");
                __idempotent_key.field("id", &order.id);
                __idempotent_key.finish()
            };
            let __idempotent_call = ::idempotent::__private::Call::new(
                ::idempotent::__private::Spec::new(
                    ::core::time::Duration::from_millis(86400000u64),
                    ::core::time::Duration::from_millis(30000u64),
                    5u32,
                ),
                __idempotent_key,
            );
            let __idempotent_store = &(__self.store);
            let __idempotent_store = {
                use ::idempotent::__private::AsStore as _;
                __idempotent_store.__idempotent_as_store()
            };
            ::idempotent::__private::run_infallible(
                    __idempotent_call,
                    __idempotent_store,
                    async {
                        let _: () = {
                            let _ = &order.id;
                        };
                    },
                )
                .await
        })
    }
}
