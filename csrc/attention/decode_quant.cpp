// paged_decode_quant over byte formats (a lookup table, int8, fp8 e4m3 and e5m2): decode.h's templates, instantiated here.
#include "decode.h"

namespace kvcache {

template void decode_quant<0>(const Decode&, const QuantLayout&);
template void decode_quant<1>(const Decode&, const QuantLayout&);
template void decode_quant<5>(const Decode&, const QuantLayout&);
template void decode_quant<6>(const Decode&, const QuantLayout&);

}  // namespace kvcache
