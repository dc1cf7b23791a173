use idempotent::idempotent;

struct Order {
    order_id: u64,
}

#[idempotent(key = "order:{order_id}", message = ordr)]
async fn handle(tenant: u32, order: Order) {
    let _ = (tenant, order.order_id);
}

fn main() {}
