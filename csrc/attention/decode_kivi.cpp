// paged_decode_quant over KIVI's int4 and int2: decode.h's templates, instantiated here.
#include "decode.h"

namespace kvcache {

template void decode_quant<4>(const Decode&, const QuantLayout&);
template void decode_quant<2>(const Decode&, const QuantLayout&);

}  // namespace kvcache
