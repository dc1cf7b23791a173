use idempotent::{Classify, idempotent};
struct OrderPlaced {
    order_id: u64,
    customer: Customer,
}
struct Customer {
    id: u64,
}
#[idempotent(retryable)]
struct PayError;
#[automatically_derived]
impl ::core::fmt::Debug for PayError {
    #[inline]
    fn fmt(&self, f: &mut ::core::fmt::Formatter) -> ::core::fmt::Result {
        ::core::fmt::Formatter::write_str(f, "PayError")
    }
}
#[automatically_derived]
impl ::idempotent::Classify for PayError {
    fn class(&self) -> ::idempotent::ErrorClass {
        let Self = self;
        ::idempotent::ErrorClass::Retryable
    }
}
impl std::fmt::Display for PayError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("pay error")
    }
}
async fn process_order(
    msg: OrderPlaced,
) -> ::core::result::Result<::idempotent::Outcome<u64>, ::idempotent::Error<PayError>> {
    let __idempotent_key = {
        let mut __idempotent_key = ::idempotent::__private::KeyBuilder::new(
            "process_order",
        );
        __idempotent_key.text("order:");
        __idempotent_key.field("order_id", &msg.order_id);
        __idempotent_key.text(":");
        __idempotent_key.field("customer.id", &msg.customer.id);
        __idempotent_key.finish()
    };
    let __idempotent_call = ::idempotent::__private::Call::new(
        ::idempotent::__private::Spec::new(
            ::core::time::Duration::from_millis(600000u64),
            ::core::time::Duration::from_millis(30000u64),
            5u32,
        ),
        __idempotent_key,
    );
    let __idempotent_store = &::idempotent::__private::DefaultStore;
    ::idempotent::__private::run(
            __idempotent_call,
            __idempotent_store,
            ::idempotent::__private::classifier::<PayError>(),
            ::idempotent::__private::process_sink,
            async {
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
                    let __idempotent_fake_return: Result<u64, PayError> = loop {};
                    return __idempotent_fake_return;
                }
                Ok(msg.order_id)
            },
        )
        .await
}
