use std::sync::Arc;
use idempotent::{MemoryStore, idempotent};
struct Order {
    id: String,
}
struct Consumer {
    store: Arc<MemoryStore>,
    tenant: String,
}
impl Consumer {
    async fn handle(
        &self,
        order: &Order,
    ) -> ::core::result::Result<
        ::idempotent::Outcome<()>,
        ::idempotent::Error<::core::convert::Infallible>,
    > {
        let __idempotent_key = {
            let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new(
                "billing.charge",
            );
            __idempotent_key.field("self.tenant", &self.tenant);
            __idempotent_key.text("/");
            __idempotent_key.field("id", &order.id);
            __idempotent_key.finish()
        };
        let __idempotent_call = ::idempotent::__private::Call::new(
            ::idempotent::__private::Spec::new(
                    ::core::time::Duration::from_millis(3600000u64),
                    ::core::time::Duration::from_millis(10000u64),
                    3u32,
                )
                .with_backoff(
                    ::idempotent::__private::Backoff::exponential(
                        ::core::time::Duration::from_millis(500u64),
                        ::core::time::Duration::from_millis(60000u64),
                    ),
                ),
            __idempotent_key,
        );
        let __idempotent_store = &(self.store);
        let __idempotent_store = {
            use ::idempotent::__private::AsStore as _;
            __idempotent_store.__idempotent_as_store()
        };
        ::idempotent::__private::run_infallible(
                __idempotent_call,
                __idempotent_store,
                async {
                    let _ = &order.id;
                },
            )
            .await
    }
}
